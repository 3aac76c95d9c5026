"""One optimizer update of the run, and the loop state carried from one update to the next.

An update is global update `state.step` of the run: every rank runs its
micro-batches of that update's global batch (`TrainBatches`), gradients are
synchronized on the last one, the clipped update is applied to the weights and
every EMA shadow, or skipped as a whole when the gradient is not finite.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field

import torch

from pipeline.distributed import all_reduce_sum, plain
from pipeline.model.loss import LABELS, model_inputs, token_loss_sum
from pipeline.train.gradcheck import check_gradients_flow

log = logging.getLogger("pipeline.train")


@dataclass
class LoopState:
    """What the loop carries across updates; saved in every checkpoint's progress.json.

    `best` is the run's record of its best full evaluations ({"raw"|"ema":
    {"loss", "step", "stage", "rate"}}, see `pipeline.train.evals`);
    `eval_pending` the [kind, reason] of an evaluation a preemption interrupted,
    which the resumed attempt runs first.
    """

    step: int  # updates done in the run (the next update's global index)
    tokens_seen: int = 0
    skipped_updates: int = 0
    consecutive_nonfinite: int = 0
    best: dict = field(default_factory=dict)
    eval_pending: list | None = None

    @classmethod
    def from_progress(cls, progress: dict) -> LoopState:
        return cls(**{k: progress[k] for k in cls.__dataclass_fields__ if k in progress})

    def progress(self, **extra) -> dict:
        return {**asdict(self), **extra}


@dataclass(frozen=True)
class UpdateResult:
    loss: float  # mean loss per supervised token of the whole global batch (all ranks)
    grad_norm: float  # total norm before clipping
    lr: float
    tokens: int  # tokens of the global batch, prompts and padding included
    finite: bool  # False: the update was skipped


class Updater:
    """Runs updates; `update(state)` does update number `state.step` and advances `state`.

    `restored_from`: the checkpoint the stage resumed from, if any; the first
    update after it checks that gradients still reach the trained weights.
    """

    def __init__(self, model, parts, strategy, precision, data, *, grad_clip: float, hooks, stage: str,
                 restored_from=None):
        self.model, self.parts, self.strategy = model, parts, strategy
        self.precision, self.data, self.hooks, self.stage = precision, data, hooks, stage
        self.d = strategy.d
        self.params = [p for _, p in parts.named]
        self.max_norm = grad_clip if grad_clip > 0 else math.inf
        self.unchecked_restore = restored_from

    def __call__(self, state: LoopState) -> UpdateResult:
        step, d, scaler = state.step, self.d, self.parts.scaler
        self.hooks.update_start(step)
        batches = self.data.micro_batches(step)
        n_sup = self.data.supervised(step)  # whole global batch: the same on every rank
        loss_sum = torch.zeros((), device=d.device)
        tokens = 0
        for i, batch in enumerate(batches):
            batch = {k: v.to(d.device) for k, v in batch.items()}
            tokens += int(batch["attention_mask"].sum())
            with self.strategy.micro_batch(self.model, last=i == len(batches) - 1):
                with self.precision.autocast():
                    logits = self.model(**model_inputs(batch)).logits
                mb_loss = token_loss_sum(logits, batch[LABELS])
                # Normalize by the supervised tokens of the whole global batch (not
                # the micro-batch): the gradient is then independent of how the
                # batch is split over micro-batches and ranks. DDP (and FSDP's
                # reduce-scatter) averages over ranks, hence the world_size factor.
                scaler.scale(mb_loss * (d.world_size / max(n_sup, 1))).backward()
            loss_sum += mb_loss.detach()
        self.hooks.gradients_ready(step, self.params)
        finite, grad_norm = self._apply(step)
        lr = self.parts.scheduler.get_last_lr()[0]
        self.parts.scheduler.step()
        all_reduce_sum(d, loss_sum)
        self._advance(state, finite, tokens * d.world_size, grad_norm)
        return UpdateResult(loss=float(loss_sum) / max(n_sup, 1), grad_norm=grad_norm, lr=lr,
                            tokens=tokens * d.world_size, finite=finite)

    def _apply(self, step: int) -> tuple[bool, float]:
        """Unscale, clip and step the optimizer and EMA, unless the gradient is not finite."""
        optimizer, scaler = self.parts.optimizer, self.parts.scaler
        scaler.unscale_(optimizer)
        # Under FSDP the grads are DTensor shards and the norm is the full, cross-shard one.
        grad_norm = plain(torch.nn.utils.clip_grad_norm_(self.params, self.max_norm))
        if self.unchecked_restore is not None:  # first update after a restore: do gradients reach the weights?
            check_gradients_flow(self.parts.named, float(grad_norm), str(self.unchecked_restore), log_it=self.d.is_main)
            self.unchecked_restore = None
        finite = bool(torch.isfinite(grad_norm))
        if finite:
            scaler.step(optimizer)
            self.parts.ema.update(step)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return finite, float(grad_norm)

    def _advance(self, state: LoopState, finite: bool, tokens: int, grad_norm: float) -> None:
        state.tokens_seen += tokens
        if finite:
            state.consecutive_nonfinite = 0
        else:
            state.skipped_updates += 1
            state.consecutive_nonfinite += 1
            log.warning("[%s] update %d skipped: non-finite gradient (norm %s); %d in a row, %d in total",
                        self.stage, state.step, grad_norm, state.consecutive_nonfinite, state.skipped_updates)
        state.step += 1
