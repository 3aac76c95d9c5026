"""A torch profiler trace of a few updates of a stage, and where their time went (`profile.updates`).

Rank 0 profiles updates `start + warmup` .. `start + warmup + updates - 1` of
the stage (the first updates choose kernels and fill caches, so they are left
out) and writes, beside the stage's metrics (`stages/<stage>/profile/`):

  trace_updates_<a>-<b>.json   the trace (Chrome trace format: Perfetto, chrome://tracing)
  summary.json                 seconds and share of each category below

and prints the summary as one line. Each profiled op's self time (on a GPU the
device time of the kernels it launched, on a CPU its CPU time) goes to the category of the nearest op,
itself first, then its callers, whose name says what it is:

  matmuls     aten::mm / addmm / bmm / ... (the projections, the LM head, LoRA)
  attention   scaled_dot_product_* and flash-attention kernels, and their backward
  loss        log_softmax / nll_loss / cross_entropy / logsumexp, and their backward
  optimizer   what runs under `Optimizer.step` / `Optimizer.zero_grad` (PyTorch names them)
  EMA         under the EMA update (annotated here)
  data wait   under the micro-batch fetch (annotated here): host time the GPU may idle for
  other ops   every other op: norms, activations, casts, the gradient clip, copies

and `untraced` is the window's wall time no op accounts for (Python, launches,
waits). Profiling records what runs; it changes nothing that is computed (a
test compares the adapters bit for bit).
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import torch

from pipeline import layout

CATEGORIES = ("matmuls", "attention", "loss", "optimizer", "EMA", "data wait", "other ops", "untraced")
DATA_WAIT, EMA_UPDATE = "data wait", "EMA"  # the record_function names of the two annotations
_MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::_scaled_mm",
            "aten::mv", "aten::addmv", "aten::matmul", "aten::linear"}
_ATTENTION = ("scaled_dot_product", "flash_attn", "flashattn", "efficient_attention", "sdpa")
_LOSS = ("log_softmax", "logsoftmax", "nll_loss", "nllloss", "cross_entropy", "logsumexp")


def category_of(names: list[str]) -> str | None:
    """The category of an op from its name and its callers' (nearest first); None: no name says."""
    for name in names:
        low = name.lower()
        if name in _MATMULS:
            return "matmuls"
        if any(k in low for k in _ATTENTION):
            return "attention"
        if any(k in low for k in _LOSS):
            return "loss"
        if name.startswith("Optimizer."):
            return "optimizer"
        if name in (EMA_UPDATE, DATA_WAIT):
            return name
    return None


def _annotated(method, name: str):
    @functools.wraps(method)
    def run(*args, **kwargs):
        with torch.profiler.record_function(name):
            return method(*args, **kwargs)
    return run


class StageProfiler:
    """Profiles a window of a stage's updates; `before(step)` / `after(step)` around each update.

    Off (every call a no-op) with `profile.updates = 0`, on ranks other than 0,
    and when a resumed stage starts past the window's first update.
    """

    def __init__(self, cfg, scratch: Path, stage: str, first_step: int, stage_start: int, *, is_main: bool,
                 device: torch.device, data, ema):
        """`cfg`: the trainer's `profile` settings. `data` (its `micro_batches`) and `ema` (its `update`)
        are annotated, on this instance only, while the window runs."""
        self.start = stage_start + cfg.warmup
        self.end = self.start + cfg.updates  # exclusive
        self.enabled = cfg.updates > 0 and is_main and first_step <= self.start
        self.dir, self.stage, self.device = Path(scratch) / layout.PROFILE_DIR, stage, device
        self._annotate = [(data, "micro_batches", DATA_WAIT), (ema, "update", EMA_UPDATE)]
        self._profiler, self._started = None, 0.0

    def before(self, step: int) -> None:
        if not self.enabled or step != self.start:
            return
        for obj, method, name in self._annotate:
            setattr(obj, method, _annotated(getattr(obj, method), name))
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.start()
        self._started = time.perf_counter()

    def after(self, step: int) -> str | None:
        """`step`: updates done. At the window's end: stop, write, and return the summary line."""
        if self._profiler is None or step != self.end:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the window's kernels belong to it
        wall = time.perf_counter() - self._started
        self._profiler.stop()
        for obj, method, _ in self._annotate:
            delattr(obj, method)  # the class's own method again
        self.dir.mkdir(parents=True, exist_ok=True)
        self._profiler.export_chrome_trace(str(self.dir / layout.PROFILE_TRACE.format(start=self.start,
                                                                                     end=self.end - 1)))
        summary = summarize(self._profiler.events(), wall, device=self.device.type == "cuda")
        summary.update(stage=self.stage, updates=[self.start, self.end - 1])
        (self.dir / layout.PROFILE_SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
        self._profiler = None
        return line(summary)


def summarize(events, wall_s: float, *, device: bool) -> dict:
    """Seconds per category (module docstring) of the profiled `events` over `wall_s` seconds.

    `device`: the ops' device (GPU) time, else their CPU time. Data wait is host
    time either way: the time the fetch took, what the GPU would idle for.
    `events` are the profiler's: CPU ops (their kernels' device time attached) and,
    on a GPU, the kernels as events of their own, which are not counted again.
    """
    from torch.autograd import DeviceType

    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for event in events:
        if event.device_type != DeviceType.CPU:
            # A kernel: the CPU op that launched it already carries its time (its self device time
            # sums its kernels'); counting the kernel event as well would count that time twice.
            continue
        names, parent = [event.name], event.cpu_parent
        while parent is not None:
            names.append(parent.name)
            parent = parent.cpu_parent
        kind = category_of(names) or "other ops"
        if kind == DATA_WAIT:
            own = event.self_cpu_time_total
        else:
            own = event.self_device_time_total if device else event.self_cpu_time_total
        seconds[kind] += own / 1e6
    traced = sum(seconds.values())
    seconds["untraced"] = max(wall_s - traced, 0.0)
    total = max(traced + seconds["untraced"], 1e-12)
    return {"wall_s": wall_s, "time": "device" if device else "cpu", "seconds": seconds,
            "share": {k: v / total for k, v in seconds.items()}}


def line(summary: dict) -> str:
    """One line: where the window's time went."""
    a, b = summary["updates"]
    shares = ", ".join(f"{k} {100 * v:.0f}%" for k, v in summary["share"].items())
    return (f"[{summary['stage']}] profile of updates {a}..{b} ({summary['wall_s']:.2f} s, "
            f"{summary['time']} time): {shares}")
