"""The FSDP2 strategy (`fully_shard`) for models that do not fit one device.

Selected by `distributed.strategy=fsdp` when more than one process runs (one
process has nothing to shard over and trains unsharded, like DDP would); the
`FSDP` class implements the interface of `pipeline.train.strategy`.

- Every rank builds the same model from the same seed on the CPU, then
  `wrap()` applies `fully_shard` to each decoder layer (and, in a
  vision-language model, each vision encoder block) and to the root: each
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
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.errors import UserError
from pipeline.model import loading
from pipeline.distributed import Dist, any_rank, barrier, check_consistent, plain
from pipeline.checkpoint.state import TrainedState

log = logging.getLogger(__name__)

_OPTIM_KEY = "optim"  # top-level DCP entry of the optimizer state (not read by the export side)


def _decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks of an HF model (its `_no_split_modules` classes), outermost first."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kinds = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in kinds]
    # A no-split class nested inside another one is sharded with its parent.
    inner = {id(c) for m in layers for c in m.modules() if c is not m}
    return [m for m in layers if id(m) not in inner]


def _shard(model, d: Dist):
    """`fully_shard` each decoder layer, then the root (embeddings, final norm, head); returns the model.

    Per-layer units are what bound the memory: only one layer is unsharded at a
    time. The root unit owns what is left, tied embeddings included. Every unit
    reshards after its forward, so between forwards each rank holds its shards only.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(d.device.type, (d.world_size,))
    layers = _decoder_layers(model)
    if not layers:
        log.warning("no decoder layers found (_no_split_modules): sharding the model as one unit")
    # A vision-language model's _no_split_modules name its vision blocks too: both sides get units.
    kinds = collections.Counter(type(layer).__name__ for layer in layers)  # before fully_shard renames the classes
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    log.info("fully_shard units: %s + root", ", ".join(f"{n} x{c}" for n, c in sorted(kinds.items())) or "none")
    # The root too reshards after forward (FSDP2 keeps it unsharded until the backward by
    # default): an evaluation forward has no backward, and would leave unsharded copies
    # of the embeddings and head behind, which the next forward reuses as they are, blind
    # to an EMA swap or an optimizer step on the shards, and which DCP cannot save.
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
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
    """[sum, sum of |x|] of the full (unsharded) parameters, in float64, the same on every rank."""
    local = torch.zeros(2, dtype=torch.float64, device=d.device)  # on the device: NCCL reduces no CPU tensor
    for p in params:
        t = _local(p).detach().double()
        local[0] += t.sum()
        local[1] += t.abs().sum()
    dist.all_reduce(local)
    return local.tolist()


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


def _save_sharded(d: Dist, model, names: list[str], ema, optimizer, staging: Path) -> None:
    """All ranks: write the sharded state into `staging` (later moved to `<ckpt>/dcp/`). Collective."""
    import torch.distributed.checkpoint as dcp

    if d.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier(d)
    # Returns once every rank's shard files are written (and fsynced) and rank 0 wrote .metadata.
    dcp.save(_dcp_state(model, names, ema, optimizer), checkpoint_id=str(staging))


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
    set_optimizer_state_dict(model, optimizer, state[_OPTIM_KEY])


# ----------------------------------------------------------------------- the strategy


class FSDP:
    """Sharded data parallel: each rank holds 1/world of every weight, EMA shadow and optimizer state."""

    sharded = True
    # Every rank holds a shard that the evaluation forward gathers: all of them evaluate.
    evaluates_here = True
    consistency = "sharded (FSDP)"

    def __init__(self, d: Dist):
        self.d = d

    def agree(self, flag: bool) -> bool:
        return any_rank(self.d, flag)  # every rank evaluates: all stop together or none does

    def load_device(self) -> torch.device:
        return torch.device("cpu")  # fully_shard moves each rank's shard to its device

    def wrap(self, model):
        # Shards are cut from each rank's own copy: those must agree before, as
        # the optimizer and EMA must see the sharded (DTensor) parameters after.
        check_consistent(self.d, [p for _, p in loading.trainable(model)], "initial trained weights before sharding")
        return _shard(model, self.d)

    def unwrap(self, model):
        return model  # fully_shard keeps the module and its parameter names

    def ema_view(self, named):
        return _local_named(named)

    @contextmanager
    def micro_batch(self, model, last: bool):
        # FSDP2's no_sync: skip the reduce-scatter on every micro-batch but the last of an update.
        model.set_requires_gradient_sync(last)
        yield

    def capture(self, parts, staging: Path) -> TrainedState:
        """All ranks write their shards of weights, EMA and optimizer into `staging` (DCP)."""
        _save_sharded(self.d, parts.model, parts.names, parts.ema, parts.optimizer, staging)
        params = [p for _, p in loading.trainable(parts.model)]
        return TrainedState(sharded_dir=staging, progress={"weights_checksum": _checksum(self.d, params)})

    def restore(self, parts, ckpt) -> None:
        """Each rank loads its shards of a dcp/ checkpoint in place, then checks their sum."""
        _load_sharded(self.d, parts.model, parts.names, parts.ema, parts.optimizer, ckpt.dcp_dir)
        params = [p for _, p in loading.trainable(parts.model)]
        _check_restored(self.d, params, ckpt.progress.get("weights_checksum"), ckpt.path)

    def gather_trained(self, parts) -> dict:
        """Full CPU tensors of the trained weights, gathered from the shards (every rank gets them)."""
        live = dict(parts.model.named_parameters())
        return {key: plain(live[n].detach()).to("cpu", copy=True).contiguous()
                for key, n in loading.saved_key_map(parts.model, parts.names).items()}

    def check_ranks(self, params, what: str) -> None:
        """Ranks hold different shards: nothing to compare (restores check their checksum instead)."""
