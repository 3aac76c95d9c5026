"""Evaluation inside a stage, and the run's best weights.

Two kinds, both on the validation set, raw weights and every EMA rate (each
swapped in and out):

quick   the first `validation.quick_batches` batches, every `validation.quick_every` updates
        and on an alert; logged only.
full    the whole validation set (its first `validation.max_records` records), every
        `validation.every` updates of the run and after its last update; tracks the best
        weights of the run. (Not at every stage end: how a run is cut into stages must not
        change what it computes. The `evaluate_stage` rule evaluates each stage's final weights.)

Best tracking: the lowest full-eval loss of the raw weights and, separately, of
any EMA rate. When one improves, its weights are saved by the checkpointer
(`best/<kind>/step_<update>/` in the scratch dir, with `best.json`). The record
of the bests travels in the loop state (so a chunked run tracks what one long
run tracks); the stage's output carries the best dirs it improved, and the
export finds the final ones through the last stage's record
(`python -m pipeline export-best`).

A preemption signal that arrives during an evaluation abandons it; the loop
state marks it pending, and the resumed attempt runs it first, so no
evaluation (and no best) is lost.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext

from pipeline.distributed import gather_objects
from pipeline.model.loss import batch_loss_sums, mean_loss, num_batches

log = logging.getLogger("pipeline.train")


class Evaluator:
    """Quick and full evaluations of the live model, and the run's best weights.

    `loss_model` is the stage's `TokenLoss` without a DDP wrapper (under FSDP the
    sharded root every rank calls). Every rank evaluates its share of the
    validation batches (`_loss`). `stop` is the stage's `Preemption`: a signal
    that arrives meanwhile abandons the evaluation on every rank at the same
    batch (`strategy.agree`).
    """

    def __init__(self, cfg, val, loss_model, parts, strategy, precision, *, monitor, checkpointer, stop, hooks,
                 stage: str):
        """`val`: the `Collator` of the validation cache, or None (no validation set: nothing to evaluate)."""
        self.cfg, self.val, self.parts, self.strategy = cfg, val, parts, strategy
        self.loss_model = loss_model
        self.precision, self.monitor, self.checkpointer = precision, monitor, checkpointer
        self.stop, self.hooks, self.stage = stop, hooks, stage

    def due(self, step: int, total: int) -> str | None:
        """Which evaluation the update just finished calls for, if any (`total`: the run's updates)."""
        if self.val is None:
            return None
        if step == total or (self.cfg.every and step % self.cfg.every == 0):
            return "full"
        if self.cfg.quick_every and step % self.cfg.quick_every == 0:
            return "quick"
        return None

    def run(self, state, kind: str, reason: str) -> None:
        """Evaluate after update `state.step`; records a new best in `state.best`, or, when a
        preemption signal interrupted it, marks it pending in `state.eval_pending`."""
        self.hooks.eval_start(state.step, redo=state.eval_pending is not None)
        started = time.perf_counter()
        results = self._losses(kind) if self.val is not None else {}
        if results is None:  # preempted: the checkpoint about to be written asks the next attempt to redo it
            state.eval_pending = [kind, reason]
            return
        state.eval_pending = None
        if not results:  # no validation set
            return
        if self.strategy.d.is_main:
            log.info("[%s] %s eval at update %d (%s): %s", self.stage, kind, state.step, reason,
                     ", ".join(f"{k}={v:.4f}" for k, v in results.items()))
        self.monitor.event({"step": state.step, "event": "eval", "kind": kind, "reason": reason,
                            "seconds": time.perf_counter() - started, "world_size": self.strategy.d.world_size,
                            **{f"val_{k}": v for k, v in results.items()}})
        if kind == "full":
            self._track_best(state, results)

    def _losses(self, kind: str) -> dict[str, float] | None:
        """Validation loss of every EMA rate, then the raw weights; None if preempted meanwhile."""
        ema = self.parts.ema
        results: dict[str, float] = {}
        for rate, tag in [*zip(ema.rates, ema.tags), (None, None)]:
            with ema.swapped_in(rate) if rate is not None else nullcontext():
                loss = self._loss(self.cfg.quick_batches if kind == "quick" else None)
            if loss is None:
                return None
            results["raw" if rate is None else f"ema_{tag}"] = loss
        return results

    def _loss(self, max_batches: int | None) -> float | None:
        """Data-parallel validation loss: batch b on rank b % world, the sums gathered and added
        in batch order, so every world size computes the same number, bit for bit.

        Every rank runs the same number of forwards (a rank short of batches
        repeats its first, unused): under FSDP each forward is collective.
        """
        d = self.strategy.d
        n = num_batches(self.val.cache, self.cfg.batch_size, max_batches)
        mine = list(range(d.rank, n, d.world_size))
        rounds = -(-n // d.world_size)
        padded = mine + [mine[0] if mine else 0] * (rounds - len(mine))
        sums = batch_loss_sums(self.loss_model, self.val, padded, micro_batch=self.cfg.batch_size, device=d.device,
                               autocast=self.precision.autocast, should_stop=self._should_stop)
        if sums is None:
            return None
        everyone = gather_objects(d, list(zip(mine, sums[:len(mine)])))
        by_batch = dict(pair for part in everyone for pair in part)
        return mean_loss([by_batch[b] for b in range(n)])["loss"]

    def _should_stop(self) -> bool:
        return self.strategy.agree(self.stop.flagged)

    def _track_best(self, state, results: dict[str, float]) -> None:
        ema = self.parts.ema
        candidates = {"raw": (results["raw"], None)}
        if ema.rates:
            candidates["ema"] = min(((results[f"ema_{tag}"], rate) for rate, tag in zip(ema.rates, ema.tags)),
                                    key=lambda x: x[0])
        for kind, (loss, rate) in candidates.items():
            current = state.best.get(kind)
            if current is not None and not loss < current["loss"]:
                continue
            record = {"loss": loss, "step": state.step, "stage": self.stage, "rate": rate}
            state.best[kind] = record
            with ema.swapped_in(rate) if rate is not None else nullcontext():
                self.checkpointer.save_best(kind, record)
            where = f"EMA {rate}" if rate is not None else "raw weights"
            log.info("[%s] new best %s: val loss %.4f at update %d", self.stage, where, loss, state.step)

