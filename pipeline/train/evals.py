"""Evaluation inside a stage, and the run's best weights.

Three kinds, all on the validation set, raw weights and every EMA rate (each
swapped in and out):

quick   the first `eval.quick_batches` batches, every `eval.quick_every` updates
        and on an alert; logged only.
full    the whole validation set, every `eval.eval_every` updates of the run and
        after its last update; tracks the best weights of the run. (Not at every
        stage end: how a run is cut into stages must not change what it computes.
        The `evaluate_stage` rule evaluates each stage's final weights.)

Best tracking: the lowest full-eval loss of the raw weights and, separately, of
any EMA rate. When one improves, its weights are written (PEFT dir, or HF
weights in full fine-tuning) to `<scratch>/best/{raw,ema}/step_<update>/` with a
`best.json` naming stage, update, loss and rate (one dir per update, so an attempt
that died after a newer best never overwrites the one a resumed attempt keeps). The record of the bests travels in the
checkpoint's progress (so a chunked run tracks what one long run tracks); the
stage's output carries the `best/` dirs it improved, and the export finds the
final ones through the last stage's record (`python -m pipeline export-best`).

A preemption signal that arrives during an evaluation abandons it; the stage
checkpoints with the evaluation marked pending and the resumed attempt runs it
first, so no evaluation (and no best) is lost.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable

from pipeline.evaluate.metrics import validation_loss

log = logging.getLogger("pipeline.train")

BEST_DIR = "best"
BEST_META = "best.json"
KINDS = ("raw", "ema")


class StageEvaluator:
    """Runs quick and full evaluations of a live model and keeps the best weights.

    `best` is the run's record ({"raw": {...}, "ema": {...}}), a dict the caller
    stores in the checkpoint; this class updates it in place.
    `weights(kind, rate)` returns the trained tensors to save (saved keys, CPU);
    with `collective_weights` every participating rank calls it (FSDP: the full
    tensors are gathered from the shards), otherwise rank 0 alone.
    `write_weights(tensors, dir)` writes them as a loadable dir.
    """

    def __init__(self, *, model, ema, val_cache, pad_id: int, eval_cfg, device, autocast, stage: str,
                 participate: bool, is_main: bool, metrics, scratch: Path, best: dict, fingerprint: str,
                 weights: Callable[[str, float | None], dict], write_weights: Callable[[dict, Path], None],
                 should_stop: Callable[[], bool], collective_weights: bool = False):
        self.model, self.ema, self.val = model, ema, val_cache
        self.pad_id, self.cfg, self.device, self.autocast = pad_id, eval_cfg, device, autocast
        self.stage, self.participate, self.is_main = stage, participate, is_main
        self.metrics, self.scratch, self.best, self.fingerprint = metrics, Path(scratch), best, fingerprint
        self.weights, self.write_weights, self.should_stop = weights, write_weights, should_stop
        self.collective_weights = collective_weights

    @property
    def enabled(self) -> bool:
        return self.val is not None

    def due(self, step: int, total: int) -> str | None:
        """Which evaluation the update just finished calls for, if any (`total`: the run's updates)."""
        if not self.enabled:
            return None
        if step == total or (self.cfg.eval_every and step % self.cfg.eval_every == 0):
            return "full"
        if self.cfg.quick_every and step % self.cfg.quick_every == 0:
            return "quick"
        return None

    def run(self, step: int, kind: str, reason: str) -> bool:
        """Evaluate; False if a preemption signal interrupted it (nothing recorded then)."""
        if not self.enabled or not self.participate:
            return True
        batches = self.cfg.quick_batches if kind == "quick" else None
        results: dict[str, float] = {}

        def loss() -> float | None:
            out = validation_loss(self.model, self.val, pad_id=self.pad_id, micro_batch=self.cfg.micro_batch,
                                  device=self.device, autocast=self.autocast, max_batches=batches,
                                  should_stop=self.should_stop)
            return None if out is None else out["loss"]

        for rate, tag in zip(self.ema.rates, self.ema.tags):
            with self.ema.swapped_in(rate):
                value = loss()
            if value is None:
                return False
            results[f"ema_{tag}"] = value
        value = loss()
        if value is None:
            return False
        results["raw"] = value
        if self.is_main:
            log.info("[%s] %s eval at update %d (%s): %s", self.stage, kind, step, reason,
                     ", ".join(f"{k}={v:.4f}" for k, v in results.items()))
        self.metrics.write({"step": step, "event": "eval", "kind": kind, "reason": reason,
                            **{f"val_{k}": v for k, v in results.items()}})
        if kind == "full":
            self._track_best(step, results)
        return True

    def _track_best(self, step: int, results: dict[str, float]) -> None:
        candidates = {"raw": (results["raw"], None)}
        ema = [(results[f"ema_{tag}"], rate) for rate, tag in zip(self.ema.rates, self.ema.tags)]
        if ema:
            candidates["ema"] = min(ema, key=lambda x: x[0])
        for kind, (loss, rate) in candidates.items():
            current = self.best.get(kind)
            if current is not None and not loss < current["loss"]:
                continue
            record = {"loss": loss, "step": step, "stage": self.stage, "rate": rate}
            self.best[kind] = record
            if self.is_main or self.collective_weights:
                if rate is None:
                    tensors = self.weights(kind, None)
                else:
                    with self.ema.swapped_in(rate):
                        tensors = self.weights(kind, rate)
            if self.is_main:
                _write_best(best_dir(self.scratch, kind, step), tensors, {**record, "fingerprint": self.fingerprint},
                            self.write_weights)
            where = f"EMA {rate}" if rate is not None else "raw weights"
            log.info("[%s] new best %s: val loss %.4f at update %d", self.stage, where, loss, step)


def best_dir(root: Path, kind: str, step: int) -> Path:
    return Path(root) / BEST_DIR / kind / f"step_{step:06d}"


def _write_best(target: Path, tensors: dict, meta: dict, write_weights) -> None:
    """Replace `target` by a dir holding these weights and best.json (via a temp dir + rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write_weights(tensors, tmp)
    (tmp / BEST_META).write_text(json.dumps(meta, indent=1) + "\n")
    old = target.with_name(f"{target.name}.old-{os.getpid()}")
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def publish_best(scratch: Path, out: Path, best: dict, stage: str) -> None:
    """Copy the best weights this stage found (if the record still names them) into its output."""
    for kind in KINDS:
        record = best.get(kind)
        if not record or record["stage"] != stage:
            continue
        src = best_dir(scratch, kind, record["step"])
        if not (src / BEST_META).is_file():
            raise RuntimeError(f"{src} is missing: the best {kind} weights of update {record['step']} were not saved")
        shutil.copytree(src, Path(out) / BEST_DIR / kind)
