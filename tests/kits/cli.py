"""The pipeline's CLI run from tests in processes of their own, forked from the test's."""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import tempfile
import time
import traceback


def run_cli_forked(jobs: dict[str, list], *, parallel: int = 2, timeout: float = 180) -> dict[str, subprocess.CompletedProcess]:
    """`python -m pipeline *args` for each job, each in a process of its own, `parallel` at a time:
    children forked from this one once the command's modules are imported here, so each skips a new
    interpreter's start and imports (~3 s a run, the whole of a one-record validation). What the
    subprocess gives: the exit code (`pipeline.cli.main`'s, or 1 with the traceback on stderr), the
    stdout and stderr written to fds 1 and 2."""
    from pipeline import cli

    for name in {args[0] for args in jobs.values()}:
        importlib.import_module(cli.COMMANDS[str(name)][0].partition(":")[0])
    pending, running, done = list(jobs.items()), {}, {}
    while pending or running:
        while pending and len(running) < parallel:
            name, args = pending.pop(0)
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the child: never returns into pytest
                code = 1
                try:
                    os.dup2(out.fileno(), 1)
                    os.dup2(err.fileno(), 2)
                    sys.stdout = open(1, "w", closefd=False, buffering=1)
                    sys.stderr = open(2, "w", closefd=False, buffering=1)
                    logging.root.handlers.clear()  # pytest's capture handlers: a fresh interpreter has none
                    code = int(cli.main([str(a) for a in args]) or 0)
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                except BaseException:  # noqa: BLE001 (as an uncaught exception ends a process)
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            running[pid] = (name, args, out, err, time.monotonic())
        # Only our own children: another child of this process (a server a fixture started) is not ours to reap.
        ended = None
        for child in running:
            pid, status = os.waitpid(child, os.WNOHANG)
            if pid:
                ended = pid, status
                break
        if ended is None:
            for child, (*_, started) in running.items():
                if time.monotonic() - started > timeout:
                    os.kill(child, 9)
            time.sleep(0.02)
            continue
        pid, status = ended
        name, args, out, err, _ = running.pop(pid)
        text = []
        for f in (out, err):
            f.seek(0)
            text.append(f.read().decode(errors="replace"))
            f.close()
        done[name] = subprocess.CompletedProcess([sys.executable, "-m", "pipeline", *map(str, args)],
                                                 os.waitstatus_to_exitcode(status), *text)
    return done
