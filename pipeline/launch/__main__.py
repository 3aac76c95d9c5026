"""`python -m pipeline.launch --log LOG [--gpus 0|N|all] [--train --nproc auto|N] -- CMD...`

Runs CMD (with `--train`: `-m pipeline train ...`, started as one process or
under torchrun) with its output in LOG, on GPUs of its own, and shows on stderr
why it failed, if it does. See `pipeline.launch` for the parts.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pipeline.launch import gpus, run, torchrun


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: python -m pipeline.launch --log LOG [--gpus SPEC] [--train --nproc N] -- CMD...")
    split = argv.index("--")
    ap = argparse.ArgumentParser(prog="python -m pipeline.launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--log", type=Path, required=True, help="the rule's log file (appended to)")
    ap.add_argument("--gpus", default="0", help="GPUs the job takes: 0, a count, or all (default 0)")
    ap.add_argument("--train", action="store_true", help="CMD is a training stage's `-m pipeline train ...`")
    ap.add_argument("--nproc", default="auto", help="training processes per node: auto (one per GPU) or N")
    args = ap.parse_args(argv[:split])
    cmd = argv[split + 1:]

    def note(message: str) -> None:
        print(f"pipeline.launch: {message}", file=sys.stderr, flush=True)

    devices = gpus.acquire(args.gpus, wait_message=note)
    env = dict(os.environ)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices.visible
    if args.train:
        cmd = torchrun.command(cmd, torchrun.processes(args.nproc, devices.ids if devices else None))
    try:
        return run.run(cmd, args.log, env=env, preemptible=args.train)
    finally:
        if devices is not None:
            devices.release()


if __name__ == "__main__":
    sys.exit(main())
