"""The FSDP2 strategy (`fully_shard`) for models that do not fit one device.

Selected by `distributed.strategy=fsdp` when more than one process runs (one
process has nothing to shard over and trains unsharded, like DDP would); the
`FSDP` class implements the interface of `pipeline.train.strategy`.

- Every rank builds the same model (in a `TokenLoss`, so the loss's LM head
  runs inside the root's forward, where its weight is gathered) from the same
  seed on the CPU, then `build_model()` applies `fully_shard` to each decoder layer
  (and, in a vision-language model, each vision encoder block) and to the root: each
  parameter becomes a DTensor sharded on dim 0, and each rank holds (on its
  device) only its shard, plus one unsharded layer at a time during forward and
  backward. The parameter names do not change, so the optimizer state, the EMA
  and the checkpoint are keyed as in a DDP run.
- The EMA keeps fp32 shadows of this rank's local shards (`ema_view`), so
  its one fused `_foreach_lerp_` per rate touches plain tensors and no
  communication; `_dcp_state` wraps the shadows back into DTensors for saving.
- Checkpoints: the weights, every EMA shadow and the optimizer state are saved
  by all ranks together with `torch.distributed.checkpoint` into `<ckpt>/dcp/`
  (`capture`), in the layout `pipeline.checkpoint.reader` reads:
  `{"model": {key: t}, "ema": {tag: {key: t}}}` with the keys a DDP run stores
  (PEFT adapter keys under LoRA), plus `"optim"`, which the export side ignores.
  The rest of the loop state (scheduler, scaler, progress, per-rank RNG, config)
  is small and written by rank 0 as in a DDP run; `pipeline.checkpoint.io` then
  checksums every file, the DCP shards included, into the MANIFEST.
- Ranks hold different shards, so the DDP cross-rank checksum does not apply
  after sharding: `wrap` compares the ranks' weights before sharding (every rank
  built the same weights) and `restore` compares the restored
  weights with the checksum saved next to them (the full-model sum, all-reduced
  over the shards).
"""

from __future__ import annotations

import collections
import logging
import math
import os
import shutil
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline import compat
from pipeline.errors import UserError
from pipeline.model import loading
from pipeline.model.loss import TokenLoss
from pipeline.train import sharded_load
from pipeline.distributed import Dist, any_rank, barrier, check_consistent, checksum, plain
from pipeline.checkpoint.state import TrainedState, keep_implementation

log = logging.getLogger(__name__)

_OPTIM_KEY = "optim"  # top-level DCP entry of the optimizer state (not read by the export side)


def _mesh(d: Dist, hsdp: bool):
    """A flat mesh over all ranks, or (HSDP) nodes x ranks-per-node: replicate across nodes, shard within.

    With HSDP the all-gathers and reduce-scatters of the forward and backward stay
    inside a node; only the gradient all-reduce of each shard crosses nodes.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if not hsdp:
        return init_device_mesh(d.device.type, (d.world_size,))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", d.world_size))
    if d.world_size % per_node:
        raise UserError(f"distributed.hsdp: {d.world_size} ranks do not split into nodes of {per_node}")
    return init_device_mesh(d.device.type, (d.world_size // per_node, per_node), mesh_dim_names=("replicate", "shard"))


def _shard(model, mesh, compute_dtype: torch.dtype | None):
    """`fully_shard` each decoder layer, then the root (embeddings, final norm, head); returns the model.

    Per-layer units are what bound the memory: only one layer is unsharded at a
    time. The root unit owns what is left, tied embeddings included. Every unit
    reshards after its forward, so between forwards each rank holds its shards only.
    With a half-precision `compute_dtype` (bf16/fp16 autocast), parameters are
    all-gathered in that dtype and gradients reduced in fp32.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if compute_dtype else None
    kwargs = {"mesh": mesh, **({"mp_policy": policy} if policy else {})}
    layers = loading.decoder_layers(model)
    if not layers:
        log.warning("no decoder layers found (_no_split_modules): sharding the model as one unit")
    # A vision-language model's _no_split_modules name its vision blocks too: both sides get units.
    kinds = collections.Counter(type(layer).__name__ for layer in layers)  # before fully_shard renames the classes
    for layer in layers:
        fully_shard(layer, **kwargs)
    log.info("fully_shard units: %s + root", ", ".join(f"{n} x{c}" for n, c in sorted(kinds.items())) or "none")
    # The root too reshards after forward (FSDP2 keeps it unsharded until the backward by
    # default): an evaluation forward has no backward, and would leave unsharded copies
    # of the embeddings and head behind, which the next forward reuses as they are, blind
    # to an EMA swap or an optimizer step on the shards, and which DCP cannot save.
    fully_shard(model, reshard_after_forward=True, **kwargs)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    # to_local() is a view of the shard FSDP keeps: in-place updates of one show in the other.
    return t.to_local() if isinstance(t, DTensor) else t


def _local_named(named: list[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, torch.Tensor]]:
    """(name, this rank's shard) of each parameter: what the EMA averages."""
    with torch.no_grad():
        return [(n, _local(p)) for n, p in named]


# ----------------------------------------------------------------------- consistency


@torch.no_grad()
def _checksum(d: Dist, params: list[torch.Tensor]) -> list[float]:
    """[sum, sum of |x|] of the full (unsharded) parameters, in float64, the same on every rank.

    Summed over the shards of one copy: under HSDP each node-group holds a full copy.
    """
    local = checksum([_local(p) for p in params], d.device)  # on the device: NCCL reduces no CPU tensor
    group = _shard_group(params[0]) if params else None
    dist.all_reduce(local, group=group)
    return local.tolist()


def _shard_group(p: torch.Tensor):
    """The process group over which `p` is sharded (None: all ranks)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor) or p.device_mesh.ndim == 1:
        return None
    return p.device_mesh.get_group(p.device_mesh.ndim - 1)


def _check_restored(d: Dist, params: list[torch.Tensor], saved: list[float] | None, source: Path) -> None:
    """Fail if the restored shards do not add up to the checksum saved with them.

    Exact for the same world size; the tolerance only absorbs the float64
    summation order of another sharding.
    """
    if saved is None:
        return
    now = _checksum(d, params)
    tol = 1e-9 * max(1.0, abs(saved[1]))
    if any(not math.isclose(a, b, rel_tol=0.0, abs_tol=tol) for a, b in zip(now, saved)):
        raise RuntimeError(f"weights restored from {source} do not match their saved checksum "
                           f"(now {now}, saved {saved}): the sharded load went wrong")


@torch.no_grad()
def _gather_to_main(d: Dist, p: torch.Tensor) -> torch.Tensor | None:
    """The full tensor of a dim-0-sharded parameter on global rank 0 (on the CPU), None elsewhere.

    Shards travel to rank 0 one parameter at a time (padded to the chunk size
    for `gather`); only ranks of rank 0's replica take part under HSDP, and no
    other rank ever holds the full tensor.
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return p.detach().to("cpu", copy=True) if d.is_main else None
    mesh = p.device_mesh
    if mesh.ndim > 1 and mesh.get_local_rank(0) != 0:
        return None  # another replica: rank 0's replica has the same values
    group = _shard_group(p)
    size = mesh.size(mesh.ndim - 1)
    chunk = -(-p.shape[0] // size)
    local = p.to_local().detach()
    padded = local.new_zeros((chunk, *p.shape[1:]))
    padded[:local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(size)] if d.is_main else None
    dist.gather(padded, parts, dst=0, group=group)
    if not d.is_main:
        return None
    return torch.cat(parts)[:p.shape[0]].to("cpu").contiguous()


# ----------------------------------------------------------------------- checkpoints


def _dcp_state(model, names: list[str], ema, optimizer) -> dict:
    """The nested state dict saved to (and loaded from) `<ckpt>/dcp/`; values alias the live tensors.

    Loading into it therefore restores the model, the EMA shadows and (after
    `set_optimizer_state_dict`) the optimizer in place. The optimizer entry
    comes from `get_optimizer_state_dict`, which first initializes an empty
    optimizer state by a zero-lr step: the weights are unchanged by it.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    key_of = {name: key for key, name in loading.saved_key_map(model, names).items()}
    shadows = {}
    for rate, tag in zip(ema.rates, ema.tags):
        shadows[tag] = {}
        for name, shadow in zip(ema.names, ema.shadows[rate]):
            p = params[name]
            # Same sharding as the parameter; from_local shares the shadow's storage.
            shadows[tag][key_of[name]] = DTensor.from_local(
                shadow, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)
    return {
        "model": {key_of[n]: params[n] for n in names},
        "ema": shadows,
        _OPTIM_KEY: get_optimizer_state_dict(model, optimizer),
    }


def _save_sharded(d: Dist, model, names: list[str], ema, optimizer, staging: Path, group, stager=None) -> Future:
    """All ranks: write the sharded state into `staging` (later moved to `<ckpt>/dcp/`). Collective.

    With `group` (a gloo group of its own), asynchronously: the state is copied to
    CPU memory (by `stager`, into its buffers) before this returns, and the files
    are written on a background thread whose collectives use `group`, so they
    never interleave with the training's. The future is done when every rank's
    files and rank 0's .metadata are.
    """
    import torch.distributed.checkpoint as dcp

    if d.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier(d)
    state = _dcp_state(model, names, ema, optimizer)
    if group is not None:
        return compat.async_save(state, checkpoint_id=str(staging), process_group=group, stager=stager)
    future: Future = Future()
    future.set_result(dcp.save(state, checkpoint_id=str(staging)))
    return future


def _load_sharded(d: Dist, model, names: list[str], ema, optimizer, root: Path) -> None:
    """All ranks: restore weights, EMA shadows and optimizer state from a `dcp/` dir, in place. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    state = _dcp_state(model, names, ema, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(root))
    except CheckpointException as err:  # (a BaseException) rank -> (exception, traceback); the planner's say what
        cause = next(iter(err.failures.values()), (err,))
        cause = cause[0] if isinstance(cause, tuple) else cause
        raise UserError(f"{root} does not match the model being trained (was it written with another "
                        f"lora/model/ema config?): {str(cause)[:500]}") from None
    optim = state[_OPTIM_KEY]  # its param groups now hold the checkpoint's implementation flags too
    optim["param_groups"] = keep_implementation(optimizer, optim["param_groups"])
    set_optimizer_state_dict(model, optimizer, optim)


# ----------------------------------------------------------------------- the strategy


class FSDP:
    """Sharded data parallel: each rank holds 1/world of every weight, EMA shadow and optimizer state."""

    sharded = True
    consistency = "sharded (FSDP)"

    def __init__(self, d: Dist, cfg):
        """`cfg`: the trainer config (distributed.hsdp, distributed.meta_init, checkpoint.async_save)."""
        self.d, self.cfg = d, cfg
        self.full_ft = not cfg.lora.enabled
        # Asynchronous saves run their collectives on a gloo group of their own (created by all ranks now).
        self._save_group = dist.new_group(backend="gloo") if cfg.checkpoint.async_save else None
        # Where DCP's stager can be reused (pipeline.compat), its CPU buffers serve every save of the stage.
        self._stagers = compat.SaveStagers(d.device) if cfg.checkpoint.async_save else None
        self._last_save: Future | None = None

    def build_model(self, cfg, precision, *, checkpointed: int = 0):
        """Build the skeleton, shard it, then read each rank's shards of the base weights.

        The adapter (or, in full fine-tuning, nothing) is initialized before
        sharding from the same seed on every rank; a model whose parameter names
        the weight files do not all hold is loaded whole on every rank instead.
        """
        if cfg.distributed.meta_init:
            sharded_load.pin_mmap_threshold()  # before fully_shard frees the skeleton's blocks
        skeleton = (loading.build(cfg, precision, None, empty=True, checkpointed=checkpointed)
                    if cfg.distributed.meta_init else None)
        # Initialized here, not read: the adapter's own weights (a module trained in full as
        # modules_to_save starts as the base's, and is read like it).
        keys = sharded_load.StoredKeys(cfg.model.path) if skeleton is not None else None
        trained = set()
        if skeleton is not None and cfg.lora.enabled:
            trained = {n for n, p in loading.trainable(skeleton) if not keys.holds(n, p.shape)}
        if skeleton is not None and sharded_load.missing_keys(skeleton, keys, trained):
            log.warning("%s: some parameters are not in the weight files under their names; every rank loads "
                        "the whole model instead of its shards", cfg.model.path)
            skeleton = None
        model = skeleton if skeleton is not None else loading.build(cfg, precision, torch.device("cpu"),
                                                                    checkpointed=checkpointed)
        # Shards are cut from each rank's own copy: the weights it initialized itself (the
        # adapter; everything when loaded whole) must agree before sharding. Weights read
        # from the files after sharding are the files'.
        initialized = [p for n, p in loading.trainable(model) if skeleton is None or n in trained]
        check_consistent(self.d, initialized, "initial trained weights before sharding")
        # The loss's check of the LM head runs a forward: on a skeleton only once its weights are in.
        loss = _shard(TokenLoss(model, check=skeleton is None), _mesh(self.d, cfg.distributed.hsdp), precision.dtype)
        if skeleton is not None:
            sharded_load.load_shards(loss.lm, cfg.model.path, skip=trained, keys=keys)
            loss.check_head()  # through the sharded root: every rank takes part
        return loss

    def agree(self, flag: bool) -> bool:
        return any_rank(self.d, flag)

    def unwrap(self, model):
        return model  # fully_shard keeps the module and its parameter names

    def ema_view(self, named):
        return _local_named(named)

    @contextmanager
    def micro_batch(self, model, last: bool):
        # LoRA: the adapter's unsharded gradients are small, so they accumulate and are
        # reduce-scattered once, with the update's last micro-batch. Full fine-tuning:
        # every micro-batch reduce-scatters, so a rank never holds full unsharded
        # gradients (+1 model copy in fp32); the sharded gradients accumulate.
        model.set_requires_gradient_sync(last or self.full_ft)
        yield

    def capture(self, parts, staging: Path) -> TrainedState:
        """All ranks write their shards of weights, EMA and optimizer into `staging` (DCP)."""
        if self._last_save is not None:  # its files are written from the stager's buffers, reused now
            self._last_save.result()
        stager = self._stagers.for_save() if self._stagers is not None else None
        pending = _save_sharded(self.d, parts.model, parts.names, parts.ema, parts.optimizer, staging,
                                self._save_group, stager)
        self._last_save = pending
        params = [p for _, p in loading.trainable(parts.model)]
        return TrainedState(sharded_dir=staging, pending=pending,
                            progress={"weights_checksum": _checksum(self.d, params)})

    def restore(self, parts, ckpt) -> None:
        """Each rank loads its shards of a dcp/ checkpoint in place, then checks their sum."""
        _load_sharded(self.d, parts.model, parts.names, parts.ema, parts.optimizer, ckpt.dcp_dir)
        params = [p for _, p in loading.trainable(parts.model)]
        _check_restored(self.d, params, ckpt.progress.get("weights_checksum"), ckpt.path)

    def gather_trained(self, parts) -> dict | None:
        """Rank 0: full CPU tensors of the trained weights, gathered shard by shard; None elsewhere."""
        live = dict(parts.model.named_parameters())
        full = {key: _gather_to_main(self.d, live[n]) for key, n in loading.saved_key_map(parts.model, parts.names).items()}
        return full if self.d.is_main else None

    def check_ranks(self, params, what: str) -> None:
        """Ranks hold different shards: nothing to compare (restores check their checksum instead)."""
