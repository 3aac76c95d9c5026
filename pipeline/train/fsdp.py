"""FSDP2 (`fully_shard`) for models that do not fit one device: sharding, sharded EMA, DCP checkpoints.

Selected by `distributed.strategy=fsdp` when more than one process runs (one
process has nothing to shard over and trains unsharded, like DDP would).

- Every rank builds the same model from the same seed on the CPU, then
  `shard()` applies `fully_shard` to each decoder layer and to the root: each
  parameter becomes a DTensor sharded on dim 0, and each rank holds (on its
  device) only its shard, plus one unsharded layer at a time during forward and
  backward. The parameter names do not change, so the optimizer state, the EMA
  and the checkpoint are keyed as in a DDP run.
- The EMA keeps fp32 shadows of this rank's local shards (`local_named`), so
  its one fused `_foreach_lerp_` per rate touches plain tensors and no
  communication; `dcp_state` wraps the shadows back into DTensors for saving.
- Checkpoints: the weights, every EMA shadow and the optimizer state are saved
  by all ranks together with `torch.distributed.checkpoint` into `<ckpt>/dcp/`
  (`save_sharded`), in the layout `pipeline.export.checkpoint` reads:
  `{"model": {key: t}, "ema": {tag: {key: t}}}` with the keys a DDP run stores
  (PEFT adapter keys under LoRA), plus `"optim"`, which the export side ignores.
  The rest of the loop state (scheduler, scaler, progress, per-rank RNG, config)
  is small and written by rank 0 as in a DDP run; `pipeline.checkpoint.io` then
  checksums every file, the DCP shards included, into the MANIFEST.
- Ranks hold different shards, so the DDP cross-rank checksum does not apply
  after sharding: `check_consistent_unsharded` runs before sharding (every rank
  built the same weights) and `checksum` / `check_restored` compare the restored
  weights with the checksum saved next to them (the full-model sum, all-reduced
  over the shards).
"""

from __future__ import annotations

import logging
import math
import shutil
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.errors import UserError
from pipeline.train import model as model_setup
from pipeline.train.distributed import Dist, barrier, check_consistent

log = logging.getLogger(__name__)

STRATEGY = "fsdp"
_OPTIM_KEY = "optim"  # top-level DCP entry of the optimizer state (not read by the export side)


def enabled(strategy: str, d: Dist) -> bool:
    """True when the model is to be sharded: strategy fsdp and more than one process."""
    if strategy != STRATEGY:
        return False
    if not d.enabled:
        log.warning("distributed.strategy=fsdp with one process: nothing to shard over, training unsharded")
    return d.enabled


def build_device(d: Dist, sharded: bool) -> torch.device:
    """Where the model is loaded: the CPU when sharding (fully_shard moves each shard to the device)."""
    return torch.device("cpu") if sharded else d.device


def _decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks of an HF model (its `_no_split_modules` classes), outermost first."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kinds = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in kinds]
    # A no-split class nested inside another one is sharded with its parent.
    inner = {id(c) for m in layers for c in m.modules() if c is not m}
    return [m for m in layers if id(m) not in inner]


def shard(model, d: Dist):
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
    for layer in layers:
        fully_shard(layer, mesh=mesh)
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


def local_named(named: list[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, torch.Tensor]]:
    """(name, this rank's shard) of each parameter: what the EMA averages."""
    with torch.no_grad():
        return [(n, _local(p)) for n, p in named]


def gradient_sync(model, sync: bool):
    """FSDP2's `no_sync`: skip the reduce-scatter on every micro-batch but the last of an update."""
    model.set_requires_gradient_sync(sync)
    return nullcontext()


def replicated(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a DTensor result (e.g. the total grad norm of `clip_grad_norm_`)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


# ----------------------------------------------------------------------- consistency


def check_consistent_unsharded(d: Dist, params: list[torch.Tensor]) -> None:
    """Before sharding: every rank must have built the same weights (a shard is cut from each)."""
    check_consistent(d, params, "initial trained weights before sharding")


@torch.no_grad()
def checksum(d: Dist, params: list[torch.Tensor]) -> list[float]:
    """[sum, sum of |x|] of the full (unsharded) parameters, in float64, the same on every rank."""
    local = torch.zeros(2, dtype=torch.float64, device=d.device)  # on the device: NCCL reduces no CPU tensor
    for p in params:
        t = _local(p).detach().double()
        local[0] += t.sum()
        local[1] += t.abs().sum()
    dist.all_reduce(local)
    return local.tolist()


def check_restored(d: Dist, params: list[torch.Tensor], saved: list[float] | None, source: Path) -> None:
    """Fail if the restored shards do not add up to the checksum saved with them.

    Exact for the same world size; the tolerance only absorbs the float64
    summation order of another sharding.
    """
    if saved is None:
        return
    now = checksum(d, params)
    tol = 1e-9 * max(1.0, abs(saved[1]))
    if any(not math.isclose(a, b, rel_tol=0.0, abs_tol=tol) for a, b in zip(now, saved)):
        raise RuntimeError(f"weights restored from {source} do not match their saved checksum "
                           f"(now {now}, saved {saved}): the sharded load went wrong")


# ----------------------------------------------------------------------- checkpoints


def dcp_state(model, names: list[str], ema, optimizer) -> dict:
    """The nested state dict saved to (and loaded from) `<ckpt>/dcp/`; values alias the live tensors.

    Loading into it therefore restores the model, the EMA shadows and (after
    `set_optimizer_state_dict`) the optimizer in place. The optimizer entry
    comes from `get_optimizer_state_dict`, which first initializes an empty
    optimizer state by a zero-lr step: the weights are unchanged by it.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    key_of = {name: key for key, name in model_setup.saved_key_map(model, names).items()}
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


def save_sharded(d: Dist, model, names: list[str], ema, optimizer, staging: Path) -> None:
    """All ranks: write the sharded state into `staging` (later moved to `<ckpt>/dcp/`). Collective."""
    import torch.distributed.checkpoint as dcp

    if d.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier(d)
    # Returns once every rank's shard files are written (and fsynced) and rank 0 wrote .metadata.
    dcp.save(dcp_state(model, names, ema, optimizer), checkpoint_id=str(staging))


def load_sharded(d: Dist, model, names: list[str], ema, optimizer, root: Path) -> None:
    """All ranks: restore weights, EMA shadows and optimizer state from a `dcp/` dir, in place. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    state = dcp_state(model, names, ema, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(root))
    except CheckpointException as err:  # (a BaseException) rank -> (exception, traceback); the planner's say what
        cause = next(iter(err.failures.values()), (err,))
        cause = cause[0] if isinstance(cause, tuple) else cause
        raise UserError(f"{root} does not match the model being trained (was it written with another "
                        f"lora/model/ema config?): {str(cause)[:500]}") from None
    set_optimizer_state_dict(model, optimizer, state[_OPTIM_KEY])
