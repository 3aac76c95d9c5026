"""Run one stage of our trainer with clock hooks, exactly as `python -m pipeline train` runs it.

    torchrun --standalone --nproc-per-node 1 bench/_ours.py RESULT.json --plan ... --config ... --stage ...

The hooks wrap a few functions of the trainer to read the clock around them;
they change nothing the trainer computes. They record, as (wall, process CPU
time) pairs:

* `enter` (this file starts: interpreter and launcher are up), `imported`
  (torch, transformers, peft and the trainer imported), `first_step` (the
  first update starts: model built, restored, data opened), `returned` (the
  stage returned: final checkpoint written and published);
* `step_end`: the end of every update (when its metrics line is written);
* `ema`: the duration of every `EMA.update` call;
* `save_stall`: how long each checkpoint save held the loop (from gathering
  the snapshot until `AsyncWriter.submit` returns), and `write`: how long each
  checkpoint write took (on the writer thread when async; wall and that
  thread's CPU time).

Wall stamps are `time.time()` so the parent process can compare them with its
own launch time; durations use `perf_counter` / `process_time` / `thread_time`.
"""

from __future__ import annotations

import time

ENTER = (time.time(), time.process_time())

import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _now() -> tuple[float, float]:
    return time.time(), time.process_time()


def _timed(fn, into: list):
    """Wrap `fn` so each call appends its (wall, CPU) duration to `into`."""

    def wrapper(*args, **kwargs):
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append((time.perf_counter() - w0, time.process_time() - c0))

    return wrapper


def run(result: Path, train_argv: list[str]) -> int:
    rec: dict = {"enter": ENTER, "step_end": [], "ema": [], "save_stall": [], "write": []}

    import torch  # noqa: F401  (the imports the stage would pay anyway, attributed to "imported")
    import peft  # noqa: F401
    import transformers  # noqa: F401

    from pipeline import cli
    from pipeline.checkpoint import checkpointer as ckpt
    from pipeline.checkpoint import io as ckpt_io
    from pipeline.train import batches, ema, monitor
    import pipeline.train.stage  # noqa: F401

    rec["imported"] = _now()

    write = monitor.MetricsLog.write

    def timed_write(self, record):
        write(self, record)
        if "loss" in record:
            rec["step_end"].append(_now())

    # An update's micro-batches are cut first thing in the update, packed or padded alike.
    micro_batches = batches._Updates.micro_batches

    def first_step(self, *args, **kwargs):
        rec.setdefault("first_step", _now())
        return micro_batches(self, *args, **kwargs)

    # A save starts by capturing the RNG states (Checkpointer._snapshot) and hands the
    # write to AsyncWriter.submit, which returns at once when async.
    capture_rng, submit = ckpt.capture_rng, ckpt_io.AsyncWriter.submit
    save_started: list[float] = []

    def timed_capture_rng():
        save_started.append(time.perf_counter())
        return capture_rng()

    def timed_submit(self, fn):
        def timed_fn():
            w0, c0 = time.perf_counter(), time.thread_time()
            fn()
            rec["write"].append((time.perf_counter() - w0, time.thread_time() - c0))

        try:
            return submit(self, timed_fn)
        finally:
            if save_started:
                rec["save_stall"].append(time.perf_counter() - save_started.pop())

    monitor.MetricsLog.write = timed_write
    batches._Updates.micro_batches = first_step
    ema.EMA.update = _timed(ema.EMA.update, rec["ema"])
    ckpt.capture_rng = timed_capture_rng
    ckpt_io.AsyncWriter.submit = timed_submit

    rec["rc"] = cli.main(["train", *train_argv])
    rec["returned"] = _now()
    rec["threads"] = torch.get_num_threads()
    Path(result).write_text(json.dumps(rec))
    return rec["rc"]


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1]), sys.argv[2:]))
