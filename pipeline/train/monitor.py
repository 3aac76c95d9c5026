"""What a stage reports while it runs: metrics lines, alerts, a progress line (`Monitor`).

All of it is rank-0 only. Files are appended per update and, when a stage
resumes, truncated back to the resume point, so a stage's metrics.jsonl holds
each update exactly once however many attempts it took.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import torch

from pipeline import layout
from pipeline.layout import PROGRESS_ENV, PROGRESS_TTY_ENV


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


_CLEAR = "\x1b[K"  # erase to the end of the line


class Progress:
    """Where a stage is: one line, `[chunk01] 21/142 (run 178/300) loss ... tok/s ... ETA`.

    Three readers, each fed from the same line (rank 0 only):
      - the log (this process's stderr): a plain line every 5% of the stage and at its end,
        the same whether or not a terminal is watching;
      - the terminal Snakemake runs in (`SFT_PROGRESS_TTY`, found by `pipeline.launch` from
        /dev/tty; or stderr itself when it is a terminal): the line redrawn in place (`\\r`,
        erase to end of line) at most every `interval` seconds and ended by a newline when
        the stage ends, so Snakemake's own lines start on a line of their own;
      - `status_path` (the scratch dir's status.json): the numbers, replaced atomically every
        `status_every` seconds, for `python -m pipeline status` (a login node reads files only).
    `SFT_PROGRESS=0` turns the terminal line off.
    """

    def __init__(self, stage: str, start: int, end: int, total: int, *, enabled: bool, resume: int | None = None,
                 status_path: Path | None = None, interval: float = 2.0, status_every: float = 5.0,
                 terminal: str | None = None):
        self.stage, self.start, self.end, self.total = stage, start, end, total
        self.enabled = enabled
        self.first = start if resume is None else resume  # updates before it were done by an earlier attempt
        self.t0 = time.time()
        self.tokens = 0
        self.every = max(1, (end - start) // 20)
        self.interval, self.status_every = interval, status_every
        self.status_path = Path(status_path) if status_path is not None and enabled else None
        self.last_draw = self.last_status = float("-inf")
        self.line = ""
        self.term: int | None = None  # fd of the terminal the live line goes to
        self.tty = False  # stderr itself is that terminal (a stage run by hand)
        self.own_term = False  # self.term was opened here (closed at the end)
        if enabled and os.environ.get(PROGRESS_ENV, "1") != "0":
            self.tty = sys.stderr.isatty()
            self.term = _open_terminal(terminal if terminal is not None else os.environ.get(PROGRESS_TTY_ENV))
            self.own_term = self.term is not None
            if self.term is None and self.tty:
                self.term = sys.stderr.fileno()
            if self.term is not None:  # a stage that fails or is preempted ends its line too
                atexit.register(self.close)
        if self.status_path is not None:
            self._status("running", self.first, None)

    def text(self, step: int, loss: float, now: float | None = None) -> str:
        """The progress line of update `step` (stage's own counter, then the run's)."""
        done = step - self.first
        elapsed = max((time.time() if now is None else now) - self.t0, 1e-9)
        rate = done / elapsed
        return format_line(self.stage, step - self.start, self.end - self.start, step, self.total, loss,
                           self.tokens / elapsed, rate)

    def update(self, step: int, loss: float, tokens: int = 0) -> None:
        if not self.enabled:
            return
        now = time.time()
        self.tokens += tokens
        self.line = self.text(step, loss, now)
        last = step == self.end
        if not self.tty and ((step - self.start) % self.every == 0 or last):
            print(self.line, file=sys.stderr, flush=True)  # the log's line: unchanged by any terminal
        if self.term is not None and (now - self.last_draw >= self.interval or last):
            self._draw(self.line)
            self.last_draw = now
        if self.status_path is not None and (now - self.last_status >= self.status_every or last):
            self._status("finished" if last else "running", step, loss)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.term is not None:
            if self.line:
                self._draw(self.line + "\n")
            if self.own_term:
                os.close(self.term)
            self.term = None

    def _draw(self, line: str) -> None:
        width = _columns(self.term)
        body, newline = (line[:-1], "\n") if line.endswith("\n") else (line, "")
        if width:
            body = body[: width - 1]  # a wrapped line could not be redrawn in place
        try:
            os.write(self.term, f"\r{body}{_CLEAR}{newline}".encode())
        except BlockingIOError:
            pass  # the terminal is paused (Ctrl-S): skip this redraw, never block training
        except OSError:
            self.term = None  # the terminal went away (logged out): the log still has the lines

    def _status(self, state: str, step: int, loss: float | None) -> None:
        now = time.time()
        elapsed = max(now - self.t0, 1e-9)
        rate = (step - self.first) / elapsed
        record = {"stage": self.stage, "state": state, "step": step, "start": self.start, "end": self.end,
                  "total": self.total, "loss": loss, "tokens_per_s": self.tokens / elapsed if step > self.first else None,
                  "updates_per_s": rate if step > self.first else None,
                  "stage_eta_s": (self.end - step) / rate if rate else None,
                  "run_eta_s": (self.total - step) / rate if rate else None,
                  "started": self.t0, "updated": now, "host": socket.gethostname(), "pid": os.getpid()}
        try:
            _write_atomic(self.status_path, json.dumps(record) + "\n")
        except OSError:
            pass  # a full or read-only disk must not stop training for a status line
        self.last_status = now


def format_line(stage: str, done: int, size: int, step: int, total: int, loss: float, tokens_per_s: float,
                updates_per_s: float) -> str:
    """`[chunk01] 21/142 (run 178/300) loss 0.1715 2210 tok/s 5.42 upd/s stage ETA 0:22 run ETA 0:26`."""
    eta_stage = (size - done) / updates_per_s if updates_per_s else float("inf")
    eta_run = (total - step) / updates_per_s if updates_per_s else float("inf")
    return (f"[{stage}] {done}/{size} (run {step}/{total}) loss {loss:.4f} {tokens_per_s:.0f} tok/s "
            f"{updates_per_s:.2f} upd/s stage ETA {_fmt(eta_stage)} run ETA {_fmt(eta_run)}")


def _open_terminal(path: str | None) -> int | None:
    """A write-only fd on terminal `path` (never made this process's controlling terminal), or None."""
    if not path:
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError:
        return None
    if not os.isatty(fd):
        os.close(fd)
        return None
    return fd


def _columns(fd: int) -> int:
    try:
        return os.get_terminal_size(fd).columns
    except OSError:
        return 0


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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
        self.progress = Progress(stage.name, stage.start, stage.end, total, enabled=is_main, resume=resume_step,
                                 status_path=Path(scratch) / layout.SCRATCH_STATUS)

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
                  "skipped_total": state.skipped_updates, **_memory_mb(self.device), "epoch": epoch}
        if result.router_loss is not None:  # mixture of experts: the load-balancing loss (`pipeline.model.router`)
            record["router_loss"] = result.router_loss
        if result.loss_scale is not None:  # fp16: the GradScaler's scale, and its calibration skips
            record.update(loss_scale=result.loss_scale, scaler_skip=result.scaler_skip,
                          scaler_skips_total=state.scaler_skips)
        if step % self.log_every == 0 or step == self.end:
            self.metrics.write(record)
        self.progress.update(step, loss, result.tokens)
        return self.alerts.check(step, loss, record["tokens_per_s"], saving=saving) if result.finite else None

    def event(self, record: dict) -> None:
        """A line that is not an update: an evaluation, the ranks' consistency check."""
        self.metrics.write(record)

    def close(self) -> None:
        self.progress.close()
        self.metrics.close()


def _memory_mb(device: torch.device) -> dict[str, float]:
    """Peak memory so far: on a GPU what tensors held (`mem_mb`) and what the caching allocator took
    (`mem_reserved_mb`; the difference is its fragmentation and cache); on a CPU the peak RSS."""
    if device.type == "cuda":
        return {"mem_mb": torch.cuda.max_memory_allocated(device) / 2**20,
                "mem_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20}
    try:
        import resource

        return {"mem_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    except ImportError:  # pragma: no cover - non-POSIX
        return {"mem_mb": 0.0}
