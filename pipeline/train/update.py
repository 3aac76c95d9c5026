"""One optimizer update of the run, and the loop state carried from one update to the next.

An update is global update `state.step` of the run: every rank runs its
micro-batches of that update's global batch (`TrainBatches`), gradients are
synchronized on the last one, the clipped update is applied to the weights and
every EMA shadow, or skipped as a whole when the gradient is not finite.

Nothing in the micro-batch loop waits for the device: token counts come from
the cache, batches are copied from pinned memory without blocking, and the
loss stays on the device. The update's one collective carries every rank's
loss, whether any rank saw a non-finite gradient, and the flags the ranks must
act on together after the update (a preemption signal, an alert: see
`UpdateResult`); its one host sync reads that back with the grad norm and the
GradScaler's scale, so all ranks take the same decisions and nothing else in
the loop waits for the device.

Two kinds of skipped update (under fp16 the GradScaler multiplies the loss by
a large scale that it halves after every overflow):
  scaler calibration  a finite loss whose scaled gradient overflowed while the
                      scale was still above 1: the scale was too large, the
                      halving fixes it. Logged and counted apart.
  non-finite          anything else (a NaN loss, an overflow at scale <= 1, any
                      non-finite gradient without a scaler): counted toward
                      `precision.max_consecutive_nonfinite`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field

import torch

from pipeline.distributed import all_reduce_sum, plain
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
    skipped_updates: int = 0  # every skipped update, scaler calibration included
    consecutive_nonfinite: int = 0  # non-finite updates in a row (calibration skips neither count nor reset)
    scaler_skips: int = 0  # of skipped_updates: GradScaler calibration
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
    tokens: int  # tokens of the global batch, prompts included, padding not
    finite: bool  # False: the update was skipped
    scaler_skip: bool = False  # skipped as GradScaler calibration (see the module docstring)
    loss_scale: float | None = None  # the GradScaler's scale this update ran with (fp16 only)
    # Mixture of experts: the load-balancing loss (supervised-token-weighted mean over the global batch,
    # before its coefficient; `pipeline.model.router`), which `loss` includes x the coefficient.
    router_loss: float | None = None
    # Agreed in this update's all-reduce (true if true on any rank): a preemption signal had
    # arrived by the time of the all-reduce, and an alert raised after the previous update.
    signalled: bool = False
    alerted: bool = False


class Updater:
    """Runs updates; `update(state)` does update number `state.step` and advances `state`.

    `model` is what the loop calls (a `pipeline.model.loss.TokenLoss`, maybe
    DDP-wrapped or FSDP-sharded): a batch in, the summed loss out.
    `restored_from`: the checkpoint the stage resumed from, if any; the first
    update after it checks that gradients still reach the trained weights.
    `preemption`: the stage's `pipeline.distributed.Preemption`, whose flag
    the update's all-reduce carries.
    """

    def __init__(self, model, parts, strategy, precision, data, *, grad_clip: float, hooks, stage: str,
                 preemption, restored_from=None):
        self.model, self.parts, self.strategy, self.preemption = model, parts, strategy, preemption
        self.precision, self.data, self.hooks, self.stage = precision, data, hooks, stage
        self.d = strategy.d
        self.params = [p for _, p in parts.named]
        self.max_norm = grad_clip if grad_clip > 0 else math.inf
        self.unchecked_restore = restored_from
        self.loss_model = strategy.unwrap(model)  # the TokenLoss: it collects the router loss, if any

    def __call__(self, state: LoopState, *, alerted: bool = False) -> UpdateResult:
        """`alerted`: this rank raised an alert after the previous update (agreed in this one's all-reduce)."""
        step, d, scaler = state.step, self.d, self.parts.scaler
        self.hooks.update_start(step)
        batches = self.data.micro_batches(step)
        # Normalize by the supervised tokens of the whole global batch (not the
        # micro-batch): the gradient is then independent of how the batch is
        # split over micro-batches and ranks. DDP (and FSDP's reduce-scatter)
        # averages over ranks, hence the world_size factor.
        n_sup = self.data.supervised(step)  # whole global batch: the same on every rank
        weight = d.world_size / max(n_sup, 1)
        loss_sum = torch.zeros((), device=d.device)
        for i, (batch, seed) in enumerate(zip(batches, self.data.forward_seeds(step, len(batches)))):
            torch.manual_seed(seed)  # dropout draws of this micro-batch, whichever rank runs it
            batch = batch.to(d.device)
            with self.strategy.micro_batch(self.model, last=i == len(batches) - 1):
                with self.precision.autocast():
                    mb_loss = self.model(batch)
                scaler.scale(mb_loss * weight).backward()
            loss_sum += mb_loss.detach()
        self.hooks.gradients_ready(step, self.params)
        take = getattr(self.loss_model, "take_router_sum", None)
        router_sum = take() if take is not None else None
        grad_norm, loss, scale, signalled, alerted, router_sum = self._apply(step, loss_sum, alerted, router_sum)
        lr = self.parts.scheduler.get_last_lr()[0]
        self.parts.scheduler.step()
        result = UpdateResult(loss=loss / max(n_sup, 1), grad_norm=grad_norm, lr=lr,
                              tokens=self.data.tokens(step), finite=math.isfinite(grad_norm),
                              scaler_skip=_calibration(grad_norm, loss, scale), loss_scale=scale,
                              signalled=signalled, alerted=alerted,
                              router_loss=None if router_sum is None else router_sum / max(n_sup, 1))
        self._advance(state, result)
        return result

    def _apply(self, step: int, loss_sum: torch.Tensor, alerted: bool,
               router_sum: torch.Tensor | None = None) -> tuple[float, float, float | None, bool, bool, float | None]:
        """Unscale, clip and step the optimizer and EMA, unless the gradient is not finite.

        Returns (grad norm, summed loss of all ranks, the GradScaler's scale this
        update ran with or None, signalled, alerted: see `UpdateResult`, and the
        summed weighted router loss of all ranks or None: it rides in the same
        all-reduce); a non-finite grad norm means the update was skipped, on every rank.
        """
        optimizer, scaler = self.parts.optimizer, self.parts.scaler
        scaler.unscale_(optimizer)
        # Under FSDP the grads are DTensor shards and the norm is the full, cross-shard one.
        norm = plain(torch.nn.utils.clip_grad_norm_(self.params, self.max_norm))
        # The update's one collective and one host sync: every rank's loss, whether any rank's
        # gradient is not finite (a rank's own verdict could differ from another's), and the
        # flags for after the update. Host flags become device values by fill kernels (no copy
        # from host memory, which would wait for the stream); the preemption flag is read now,
        # as late as possible.
        flags = [loss_sum.new_full((), float(f)) for f in (self.preemption.flagged, alerted)]
        routed = [] if router_sum is None else [router_sum.float()]
        stats = all_reduce_sum(self.d, torch.stack([loss_sum.float(), (~torch.isfinite(norm)).float(), *flags,
                                                    *routed]))
        # The scale is read in the same sync (`get_scale()` would be a sync of its own), before
        # `scaler.update()` changes it in place. It exists once `scale()` has run (every update).
        scale = scaler._get_scale_async() if scaler.is_enabled() else None
        local = [norm.detach().float().reshape(1)] + ([] if scale is None else [scale.float().reshape(1)])
        loss, bad, signalled, alerted, *rest = torch.cat([stats, *local]).tolist()
        router_total = rest.pop(0) if routed else None
        grad_norm, *scale = rest
        scale = scale[0] if scale else None
        if bad:
            grad_norm = math.nan if math.isfinite(grad_norm) else grad_norm
        if self.unchecked_restore is not None:  # first update after a restore: do gradients reach the weights?
            check_gradients_flow(self.parts.named, grad_norm, str(self.unchecked_restore), log_it=self.d.is_main)
            self.unchecked_restore = None
        if not bad:
            # Not `scaler.step(optimizer)`: under fp16 it reads its found-inf flags back (a host
            # sync) only to take the decision made above, from the same gradients. unscale_
            # recorded those flags, which `scaler.update()` reads on the device.
            optimizer.step()
            self.parts.ema.update(step)
            scaler.update()
        elif scale is not None:
            _back_off(scaler, scale)
        optimizer.zero_grad(set_to_none=True)
        return grad_norm, loss, scale, bool(signalled), bool(alerted), router_total

    def _advance(self, state: LoopState, result: UpdateResult) -> None:
        state.tokens_seen += result.tokens
        if result.finite:
            state.consecutive_nonfinite = 0
        elif result.scaler_skip:
            state.skipped_updates += 1
            state.scaler_skips += 1
            log.info("[%s] update %d skipped: fp16 gradient overflow at loss scale %g (GradScaler calibration, "
                     "not counted toward precision.max_consecutive_nonfinite); %d such in total",
                     self.stage, state.step, result.loss_scale, state.scaler_skips)
        else:
            state.skipped_updates += 1
            state.consecutive_nonfinite += 1
            log.warning("[%s] update %d skipped: non-finite gradient (norm %s); %d in a row, %d in total",
                        self.stage, state.step, result.grad_norm, state.consecutive_nonfinite,
                        state.skipped_updates)
        state.step += 1


def _calibration(grad_norm: float, loss: float, scale: float | None) -> bool:
    """A skip the GradScaler's scale caused and its halving cures (see the module docstring)."""
    return scale is not None and not math.isfinite(grad_norm) and math.isfinite(loss) and scale > 1.0


def _back_off(scaler: torch.amp.GradScaler, scale: float) -> None:
    """What `scaler.update()` does after an overflow, decided for all ranks alike.

    `update()` would read each rank's own found-inf flags, which under FSDP
    (each rank checks only its shards) can differ between ranks and leave them
    with different scales. This is the same arithmetic: scale x backoff factor,
    growth tracker back to 0.
    """
    scaler.update(new_scale=scale * scaler.get_backoff_factor())  # also ends this update's bookkeeping
    scaler.load_state_dict({**scaler.state_dict(), "_growth_tracker": 0})
