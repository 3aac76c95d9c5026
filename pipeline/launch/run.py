"""Run one command with its output in the rule's log and the reason for a failure on the terminal.

Snakemake shows only "Error in rule X ... check log file(s)" when a rule whose
output goes to a log fails. So the command's stdout and stderr go to the log,
and when it fails, its own error message (`pipeline.cli` writes it to the file
named by `SFT_ERROR_FILE`) or, failing that, the last exception or error lines
of the log, go to stderr too, with the log's path, and are appended to the log
(under SLURM the terminal shows the rule's log: `show-failed-logs` in the
cluster profile). Exit codes stay those of the command.

Signals: Snakemake stops a job by sending SIGTERM to this process, SLURM's
`--signal` sends SIGUSR1 before a time limit. Both are passed to the command and
every process below it (all training ranks), as SIGUSR1 where the command is a
training stage: the ranks then save a checkpoint at the next step boundary and
exit with `layout.EXIT_PREEMPTED`, which this process returns so a retry resumes.
torchrun is started with SIGUSR1 ignored, so it waits for its ranks to finish
saving instead of tearing them down.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.errors import ERROR_FILE_ENV
from pipeline.layout import EXIT_PREEMPTED, RANK_QUIET

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Failure|Interrupt|Exit)\b.*")
_PREEMPTED = "preempted at update"
_MAX_LINES = 40
KILL_GRACE_S = 30.0  # after a sibling failed, as SLURM's default KillWait
# srun's word on a task of a multi-node stage that ended badly, and the ranks' per-node start lines
# (pipeline.watch.node_line), which say which node rank and address that host had.
_SRUN_TASK_ENDED = re.compile(r"^srun: error: (\S+): tasks? ([\d,-]+): (.+)$", re.M)
_NODE_LINE = re.compile(r"node rank (\d+) of \d+: host (\S+), address (\S+),")


def run(cmds: list[list[str]], log: Path, *, env: dict, preemptible: bool) -> int:
    """Run the commands side by side (output appended to `log`); returns the first non-zero exit code.

    Several commands: the agents of one job on this machine (`pipeline.launch.torchrun`); when
    one fails, the others are ended (`_wait`). A command killed by signal N counts as exit code
    128 + N.
    """
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    errors = log.with_name(f".{log.name}.errors")
    errors.unlink(missing_ok=True)
    env = {**env, ERROR_FILE_ENV: str(errors)}

    def in_child():  # after fork, before exec
        _die_with_parent()
        if preemptible:  # inherited by torchrun through exec; the ranks install their own handlers
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)

    with open(log, "ab", buffering=0) as out:
        out.write("".join(f"pipeline.launch: {shlex.join(cmd)}\n" for cmd in cmds).encode())
        procs = [subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                  preexec_fn=in_child) for cmd in cmds]
        stop_signal = signal.SIGUSR1 if preemptible else None

        def forward(signum, frame):
            for proc in procs:
                _signal_tree(proc.pid, stop_signal or signum)

        previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
        try:
            codes = _wait(procs)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    codes = [128 - c if c < 0 else c for c in codes]
    code = next((c for c in codes if c), 0)
    if code:
        code = _report_failure(cmds[0], log, errors, code, preemptible)
    errors.unlink(missing_ok=True)
    return code


def _wait(procs: list[subprocess.Popen], grace_s: float = KILL_GRACE_S) -> list[int]:
    """Every process's exit code. Once one has failed, the others get SIGTERM (and SIGCONT, should
    they be stopped), and SIGKILL `grace_s` later: the agents of a job on this machine end as
    `srun --kill-on-bad-exit` ends them across nodes, instead of waiting on ranks that are gone."""
    failed_at, ended = None, []
    while None in (codes := [proc.poll() for proc in procs]):
        if failed_at is None and any(codes):
            failed_at = time.monotonic()
            for proc, code in zip(procs, codes):
                if code is None:
                    ended += [proc.pid, *_descendants(proc.pid)]
                    _signal_tree(proc.pid, signal.SIGTERM)
                    _signal_tree(proc.pid, signal.SIGCONT)
        elif failed_at is not None and time.monotonic() - failed_at > grace_s:
            for proc in procs:
                _signal_tree(proc.pid, signal.SIGKILL)
        time.sleep(0.2)
    for pid in ended:  # a rank its agent left behind (torchrun starts them in sessions of their own)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return codes


def _report_failure(cmd: list[str], log: Path, errors: Path, code: int, preemptible: bool) -> int:
    """Tell the terminal (and the end of the log) why the command failed; returns the exit code."""
    text = log.read_text(errors="replace")
    if preemptible and _PREEMPTED in text:
        code = EXIT_PREEMPTED  # every rank saved; torchrun itself reports its ranks' exit as a failure
        reasons = [line for line in text.splitlines() if _PREEMPTED in line][-1:]
    else:
        reasons = _messages(errors) or _reasons_from_log(text, code)
        reasons += _quiet_ranks(text) + _first_node_ended(text)
    shown = [line for reason in reasons for line in reason.splitlines()][:_MAX_LINES]
    block = "\n".join([f"pipeline: {_name(cmd)} failed (exit {code}):", *(f"  {line}" for line in shown),
                       f"  full log: {log}"])
    print(block, file=sys.stderr, flush=True)
    with open(log, "a") as f:
        f.write(f"\n{block}\n")
    return code


def _messages(errors: Path) -> list[str]:
    """The distinct messages the command's processes reported (every rank may report the same)."""
    if not errors.is_file():
        return []
    seen: list[str] = []
    for message in errors.read_text(errors="replace").split("\n\x00\n"):
        if message.strip() and message.strip() not in seen:
            seen.append(message.strip())
    return seen


def _quiet_ranks(text: str) -> list[str]:
    """What rank 0 logged of ranks that went quiet before the failure (`pipeline.watch`): on GPUs
    NCCL's watchdog ends a stuck rank without an error message of its own, this is then the word."""
    found = [line.split("pipeline.distributed: ", 1)[1] for line in text.splitlines()
             if RANK_QUIET in line and "WARNING pipeline.distributed: " in line]
    return list(dict.fromkeys(found))[:4]


def _first_node_ended(text: str) -> list[str]:
    """The node whose task srun saw end first (a multi-node stage), with its node rank and address."""
    m = _SRUN_TASK_ENDED.search(text)
    if not m:
        return []
    host, task, how = m.groups()
    known = {h: f" (node rank {rank}, address {address})" for rank, h, address in _NODE_LINE.findall(text)}
    return [f"srun: the first task to end was task {task} on node {host}{known.get(host, '')}: {how}"]


def _reasons_from_log(text: str, code: int) -> list[str]:
    """A failure that reported nothing itself: the last exception, else ERROR lines, else the tail."""
    lines = [line for line in text.splitlines() if line.strip()]
    exceptions = [line for line in lines if _EXCEPTION_LINE.match(line) and "ChildFailedError" not in line]
    if exceptions:
        return exceptions[-1:]
    logged = [line for line in lines if " ERROR " in line or line.startswith("ERROR")]
    if logged:
        return logged[-5:]
    if code > 128:
        try:
            name = signal.Signals(code - 128).name
        except ValueError:
            name = str(code - 128)
        return [f"killed by signal {name} (out of memory? a time limit?)", *lines[-5:]]
    return lines[-10:]


def _signal_tree(pid: int, signum: int) -> None:
    """Send `signum` to `pid` and every process below it (torchrun puts each rank in a session of
    its own, so the process group of `pid` does not reach them)."""
    for target in [pid, *_descendants(pid)]:
        try:
            os.kill(target, signum)
        except ProcessLookupError:
            pass


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (Linux); none elsewhere."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when the launcher dies (even by SIGKILL), so no orphan trains on."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: an orphan is possible if the launcher is killed hard


def _name(cmd: list[str]) -> str:
    """`python -m pipeline validate ...` -> 'validate'."""
    if "pipeline" in cmd:
        i = cmd.index("pipeline")
        if i + 1 < len(cmd):
            return cmd[i + 1]
    return Path(cmd[0]).name
