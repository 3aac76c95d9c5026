"""How the model is spread over the ranks, behind one interface: replicated (one process or
DDP) here, sharded (FSDP2) in `pipeline.train.fsdp`.

The stage loop holds a strategy and never asks which one it is. What differs
between them is all in the two classes:

    build_model(cfg, precision, ..)  base + adapter in a `pipeline.model.loss.TokenLoss`, loaded, on the
                                     device, wrapped: what the loop calls (DDP wrapper / fully_shard of a
                                     skeleton read shard by shard / nothing)
    unwrap(model)                    the same without a DDP wrapper: what evaluation calls (its `.lm` is
                                     what the optimizer, EMA and checkpoints see)
    ema_view(named)                  the tensors the EMA averages (this rank's shards under FSDP)
    micro_batch(model, last)         context for one micro-batch's backward: gradients are
                                     synchronized on the update's last micro-batch only
    capture(parts, staging)          the trained state for a checkpoint (`TrainedState`; collective)
    restore(parts, ckpt)             load a checkpoint's weights, EMA shadows, optimizer (collective)
    gather_trained(parts)            full trained tensors on rank 0, for saving the best weights (collective)
    agree(flag)                      every rank's common answer (a preemption during an evaluation)
    check_ranks(params, what)        fail if the ranks' weights disagree where they should agree
    consistency                      how that check is done, for the pilot gate's report

`parts` is the `pipeline.train.parts.TrainingParts` of the stage.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

from pipeline.checkpoint.state import TrainedState, load_optimizer_state, optimizer_state
from pipeline.errors import UserError
from pipeline.model import loading
from pipeline.model.loss import TokenLoss
from pipeline.distributed import Dist, any_rank, check_consistent
from pipeline.planning.checks import refuse_quantized_sharded

log = logging.getLogger(__name__)

STRATEGIES = ("ddp", "fsdp")


def choose(cfg, d: Dist):
    """The strategy for `distributed.strategy` on this world: FSDP needs more than one process."""
    strategy = cfg.distributed.strategy
    if strategy not in STRATEGIES:
        raise UserError(f"distributed.strategy={strategy!r}: expected {' | '.join(STRATEGIES)}")
    if cfg.model.attn_implementation == "flex_attention" and d.device.type != "cuda":
        import torch

        raise UserError(f"model.attn_implementation=flex_attention trains on a CUDA GPU only: PyTorch's flex "
                        f"attention has no backward on {d.device.type} (torch {torch.__version__}); set it to sdpa "
                        "or auto for a run on this device")
    if strategy == "fsdp" and d.enabled:
        from pipeline.train.fsdp import FSDP

        refuse_quantized_sharded(cfg, f"{d.world_size} ranks")  # the plan refuses it first

        return FSDP(d, cfg)
    if strategy == "fsdp":
        log.warning("distributed.strategy=fsdp with one process: nothing to shard over, training unsharded")
    return Replicated(d)


class Replicated:
    """Every rank holds the whole model: one process, or DDP over several.

    With one process there is nothing to wrap, synchronize or compare, and
    each of those steps below is a no-op.
    """

    sharded = False

    def __init__(self, d: Dist):
        self.d = d
        self.consistency = "weight checksums" if d.enabled else "single process"

    def build_model(self, cfg, precision, *, checkpointed: int = 0):
        model = TokenLoss(loading.build(cfg, precision, self.d.device, checkpointed=checkpointed),
                          fused_loss=cfg.model.fused_loss)
        if not self.d.enabled:
            return model
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[self.d.local_rank] if self.d.device.type == "cuda" else None
        )

    def agree(self, flag: bool) -> bool:
        return any_rank(self.d, flag)

    def unwrap(self, model):
        return model.module if self.d.enabled else model

    def ema_view(self, named):
        return named

    def micro_batch(self, model, last: bool):
        # DDP all-reduces gradients on every backward unless told not to: only the
        # last micro-batch of the update needs to synchronize.
        return model.no_sync() if self.d.enabled and not last else nullcontext()

    def capture(self, parts, staging) -> TrainedState:
        """Rank 0 copies the trained state to the CPU for its checkpoint writer; the others skip."""
        if not self.d.is_main:
            return TrainedState()
        model, ema = parts.model, parts.ema
        return TrainedState(
            weights=loading.trained_state(model, parts.names),
            ema={tag: loading.to_saved_keys(model, ema.state(rate)) for rate, tag in zip(ema.rates, ema.tags)},
            optimizer=optimizer_state(parts.optimizer, parts.names),
        )

    def restore(self, parts, ckpt) -> None:
        """Load weights, every EMA shadow and the optimizer state from an unsharded checkpoint."""
        model, ema = parts.model, parts.ema
        loading.load_trained(model, parts.names, ckpt.main.all(), f"{ckpt.path} ({ckpt.main.label})")
        for rate, tag in zip(ema.rates, ema.tags):
            if tag not in ckpt.ema:
                raise UserError(f"{ckpt.path} has no EMA shadow for rate {rate} (was ema.rates changed?)")
            ema.load(rate, loading.named_to_param_names(model, parts.names, ckpt.ema[tag].all()))
        state = ckpt.training_state(self.d.rank)
        load_optimizer_state(parts.optimizer, parts.names, state["optimizer_tensors"], state["optimizer_meta"])
        self.check_ranks([p for _, p in loading.trainable(model)], "trained weights after restore")

    def gather_trained(self, parts) -> dict | None:
        """Rank 0's CPU copy of the trained weights (None on the other ranks, which skip the work)."""
        return loading.trained_state(parts.model, parts.names) if self.d.is_main else None

    def check_ranks(self, params, what: str) -> None:
        check_consistent(self.d, params, what)
