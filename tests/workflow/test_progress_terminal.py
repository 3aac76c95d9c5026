"""The stage's progress line reaches the terminal Snakemake runs in (a pseudo-terminal here),
with the stage's own counter, while the stage's log keeps the same content as a run without one."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest
from kits.run import copy_run

pytestmark = pytest.mark.workflow

LOG = "logs/train_stage/demo/pilot.log"


def _on_a_terminal(workdir, *args, timeout=300) -> tuple[int, str]:
    """`python -m snakemake *args` with a pseudo-terminal as its controlling terminal; (exit code, bytes shown)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))

    def take_terminal():  # after setsid: the pty becomes the session's controlling terminal (/dev/tty)
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("SFT_FAULTS", None)
    env.pop("SFT_PROGRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "snakemake", *args], cwd=workdir, stdin=follower, stdout=follower,
                            stderr=follower, env=env, start_new_session=True, preexec_fn=take_terminal)
    os.close(follower)
    shown, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([leader], [], [], 1.0)[0]:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: every process holding the terminal has closed it
                    break
                if not chunk:
                    break
                shown += chunk
            elif proc.poll() is not None:
                break
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)
    return code, shown.decode(errors="replace")


def _content(text: str) -> list[str]:
    """A log's lines without what depends on timing: rates, ETAs, tqdm's speeds, log timestamps, and the
    throughput-drop alert (a busy machine, as CI's two workers make it, can slow one update enough to raise
    it: its line and the quick evaluation it starts)."""
    text = re.sub(r"\d+ tok/s \S+ upd/s stage ETA \S+ run ETA \S+", "<rate>", text)
    text = re.sub(r"\[[^\]]*it/s\]", "", text)
    text = re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ", "", text, flags=re.M)
    return [line for line in text.splitlines() if "throughput drop:" not in line]


def test_progress_line_on_the_terminal_log_unchanged(done, tmp_path):
    run = copy_run(done, tmp_path / "run")
    plan = json.loads((run / "results/demo/plan.json").read_text())
    pilot = next(s for s in plan["stages"] if s["name"] == "pilot")
    size, total = pilot["end"] - pilot["start"], plan["total_updates"]
    reference = (run / LOG).read_text()  # the shared run's: no terminal (kits/run.py sets SFT_PROGRESS=0)
    (run / LOG).unlink()

    code, shown = _on_a_terminal(run, "results/demo/stages/pilot", "-f", "--cores", "2")
    assert code == 0, shown[-4000:]
    # Snakemake's own output is there, and the stage's line with its own counter, redrawn in place ...
    assert "Finished jobid" in shown and "rule train_stage:" in shown
    assert re.search(rf"\r\[pilot\] \d+/{size} \(run \d+/{total}\) loss \d+\.\d+ \d+ tok/s .* stage ETA \S+ run ETA",
                     shown), shown[-4000:]
    # ... ended by a newline at the stage's end, so the next Snakemake line starts on its own line
    assert re.search(rf"\[pilot\] {size}/{size} \(run {pilot['end']}/{total}\)[^\r\n]*\x1b\[K\r\n", shown)
    # the log: the same lines as without a terminal (no escape codes, no carriage returns added)
    log = (run / LOG).read_text()
    assert "\x1b[K" not in log
    assert _content(log) == _content(reference)
    assert any(line.startswith(f"[pilot] {size}/{size} (run {pilot['end']}/{total})") for line in log.splitlines())
