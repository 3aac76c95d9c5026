"""What a stage reports while it runs: metrics lines, alerts, a progress bar (`Monitor`).

All of it is rank-0 only. Files are appended per update and, when a stage
resumes, truncated back to the resume point, so a stage's metrics.jsonl holds
each update exactly once however many attempts it took.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import torch

from pipeline import layout


def _truncate_jsonl(path: Path, from_step: int) -> None:
    """Drop lines for updates after `from_step` (written by an attempt that died)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= from_step:
                kept.append(line)
        except ValueError:
            continue  # a line cut off by a crash
    path.write_text("".join(k + "\n" for k in kept))


class MetricsLog:
    """One JSON line per update (and per in-stage eval) in the stage's scratch dir.

    With `tensorboard_dir`, every numeric field is also a TensorBoard scalar
    (`train/<field>`, `eval/<field>`; x = the global update). A resumed attempt
    purges the events after its resume point, as it truncates the JSONL.
    """

    def __init__(self, path: Path, *, enabled: bool, truncate_from: int, tensorboard_dir: Path | None = None):
        self.path = Path(path)
        self.enabled = enabled
        self.tb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _truncate_jsonl(self.path, truncate_from)
            if tensorboard_dir is not None:
                self.tb = _summary_writer(Path(tensorboard_dir), purge_step=truncate_from + 1)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None and "step" in record:
            group = "eval" if record.get("event") == "eval" else "train"
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tb.add_scalar(f"{group}/{key}", value, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _summary_writer(log_dir: Path, purge_step: int):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        from pipeline.errors import UserError

        raise UserError("tensorboard=true needs the tensorboard package: pip install tensorboard "
                        "(or pip install -e \".[tensorboard]\")") from err
    return SummaryWriter(str(log_dir), purge_step=purge_step)


class Alerts:
    """Loss spikes (> mean + k sigma of a window) and throughput drops (< f x median)."""

    def __init__(self, cfg, path: Path, *, enabled: bool, truncate_from: int):
        self.cfg = cfg
        self.losses: deque[float] = deque(maxlen=cfg.window)
        self.tps: deque[float] = deque(maxlen=cfg.window)
        self.log = MetricsLog(path, enabled=enabled, truncate_from=truncate_from)

    def check(self, step: int, loss: float, tokens_per_s: float, *, saving: bool = False) -> str | None:
        """An alert's reason, or None. `saving`: a checkpoint write overlapped this update.

        Such an update is slow for a known reason: its throughput is neither
        judged nor added to the window (it would be a false alert, and would
        drag the median down).
        """
        reason = None
        if len(self.losses) >= 10:
            mean, sd = statistics.fmean(self.losses), statistics.pstdev(self.losses)
            if loss > mean + self.cfg.loss_spike_sigma * max(sd, 1e-3 * abs(mean), 1e-8):
                reason = f"loss spike: {loss:.4f} > mean {mean:.4f} + {self.cfg.loss_spike_sigma} sigma ({sd:.4f})"
        if reason is None and not saving and len(self.tps) >= 10:
            median = statistics.median(self.tps)
            if tokens_per_s < self.cfg.tps_drop_fraction * median:
                reason = f"throughput drop: {tokens_per_s:.0f} tokens/s < {self.cfg.tps_drop_fraction} x median {median:.0f}"
        if reason is None:
            # a spike is kept out of the window so it does not mask the next one
            self.losses.append(loss)
            if not saving:
                self.tps.append(tokens_per_s)
        else:
            print(f"ALERT update {step}: {reason}; evaluating and checkpointing now", file=sys.stderr, flush=True)
            self.log.write({"step": step, "alert": reason, "time": time.time()})
        return reason


class Progress:
    """A progress bar with ETA on a terminal; plain periodic lines otherwise."""

    def __init__(self, stage: str, start: int, end: int, total: int, *, enabled: bool):
        self.stage, self.start, self.end, self.total = stage, start, end, total
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.t0 = time.time()
        self.every = max(1, (end - start) // 20)

    def update(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        done = step - self.start
        rate = done / max(time.time() - self.t0, 1e-9)
        eta_stage = (self.end - step) / rate if rate else float("inf")
        eta_run = (self.total - step) / rate if rate else float("inf")
        text = (f"[{self.stage}] {step}/{self.end} (run {step}/{self.total}) loss {loss:.4f} "
                f"{rate:.2f} upd/s  stage ETA {_fmt(eta_stage)}  run ETA {_fmt(eta_run)}")
        if self.tty:
            width = 24
            filled = int(width * done / max(self.end - self.start, 1))
            print(f"\r|{'#' * filled}{'.' * (width - filled)}| {text}", end="", file=sys.stderr, flush=True)
        elif done % self.every == 0 or step == self.end:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)


def _fmt(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Monitor:
    """The metrics log, the alerts and the progress bar of one stage, fed once per update.

    `hooks` may change the loss it reports (`pipeline.train.faults`).
    """

    def __init__(self, cfg, scratch: Path, stage, total: int, *, is_main: bool, resume_step: int, hooks, device):
        self.log_every, self.end, self.hooks, self.device = cfg.log_every, stage.end, hooks, device
        self.metrics = MetricsLog(Path(scratch) / layout.SCRATCH_METRICS, enabled=is_main, truncate_from=resume_step,
                                  tensorboard_dir=Path(scratch) / layout.TENSORBOARD_DIR if cfg.tensorboard else None)
        self.alerts = Alerts(cfg.alerts, Path(scratch) / layout.ALERTS_FILE, enabled=is_main, truncate_from=resume_step)
        self.progress = Progress(stage.name, stage.start, stage.end, total, enabled=is_main)

    def after_update(self, state, result, started: float, *, epoch: float, saving: bool) -> str | None:
        """Log update `state.step - 1`; returns an alert's reason, if it raised one.

        `saving`: a checkpoint write overlapped the update (its throughput is not judged).
        """
        step = state.step
        loss = self.hooks.reported_loss(step - 1, result.loss)
        self.hooks.update_end(step - 1)
        seconds = time.perf_counter() - started
        record = {"step": step, "loss": loss, "lr": result.lr, "grad_norm": result.grad_norm, "tokens": result.tokens,
                  "tokens_per_s": result.tokens / seconds, "step_time_s": seconds, "skipped": not result.finite,
                  "skipped_total": state.skipped_updates, "mem_mb": _memory_mb(self.device), "epoch": epoch}
        if result.loss_scale is not None:  # fp16: the GradScaler's scale, and its calibration skips
            record.update(loss_scale=result.loss_scale, scaler_skip=result.scaler_skip,
                          scaler_skips_total=state.scaler_skips)
        if step % self.log_every == 0 or step == self.end:
            self.metrics.write(record)
        self.progress.update(step, loss)
        return self.alerts.check(step, loss, record["tokens_per_s"], saving=saving) if result.finite else None

    def event(self, record: dict) -> None:
        """A line that is not an update: an evaluation, the ranks' consistency check."""
        self.metrics.write(record)

    def close(self) -> None:
        self.progress.close()
        self.metrics.close()


def _memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    except ImportError:  # pragma: no cover - non-POSIX
        return 0.0
