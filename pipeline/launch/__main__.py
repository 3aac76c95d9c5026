"""`python -m pipeline.launch --log LOG [--gpus 0|N|all] [--train --nodes M --nproc auto|N ...] -- CMD...`

Runs CMD (with `--train`: `-m pipeline train ...`, started as one process, under
torchrun, or as one torchrun per node) with its output in LOG, on GPUs of its
own, and shows on stderr why it failed, if it does. `--print-command` prints
what it would start instead (how a dry run shows the srun / torchrun flags).
See `pipeline.launch` for the parts.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from pipeline.launch import gpus, run, torchrun
from pipeline.layout import PROGRESS_ENV, PROGRESS_TTY_ENV


def controlling_terminal() -> str | None:
    """The terminal Snakemake was started from (its /dev/pts/N path), or None: under SLURM, in CI,
    under nohup, or with SFT_PROGRESS=0.

    The training processes cannot open /dev/tty themselves: they run in sessions of their
    own (`run.run`, torchrun), which have no controlling terminal; this process still shares
    Snakemake's, and names it by its device (/dev/tty itself names whichever terminal the
    opener controls: none, for them).
    """
    if os.environ.get(PROGRESS_ENV, "1") == "0":
        return None
    try:
        os.close(os.open("/dev/tty", os.O_WRONLY | os.O_NOCTTY))
        tty_nr = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[4])
    except (OSError, ValueError, IndexError):
        return None  # no controlling terminal (or not Linux)
    device = os.makedev((tty_nr >> 8) & 0xFFF, (tty_nr & 0xFF) | ((tty_nr >> 12) & 0xFFF00))
    candidates = [os.ttyname(fd) for fd in (2, 1, 0) if os.isatty(fd)]
    candidates += [str(p) for p in sorted(Path("/dev/pts").glob("[0-9]*"))] + [str(p) for p in Path("/dev").glob("tty*")]
    for path in candidates:
        try:
            if path != "/dev/tty" and os.stat(path).st_rdev == device:
                return path
        except OSError:
            continue
    return None


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
# PyTorch 2.9 renamed it PYTORCH_ALLOC_CONF and still reads the old name: either set by the user wins.
ALLOC_CONF_NAMES = (ALLOC_CONF, "PYTORCH_ALLOC_CONF")


def allocator_env(env: dict[str, str]) -> dict[str, str]:
    """What a training job adds to `env`: expandable segments for PyTorch's CUDA allocator, unless
    the user configured the allocator.

    Without them the caching allocator keeps fixed-size segments, and the varying shapes of SFT
    micro-batches (lengths change every step) leave free memory split among segments that no new
    block fits: the fragmentation a run OOMs on while `memory_reserved` is far above
    `memory_allocated`. Expandable segments grow one mapping instead (PyTorch's CUDA semantics
    notes); the memory budget's fragmentation margin (`pipeline.model.memory.FRAGMENTATION`)
    assumes them.
    """
    if any(env.get(name) for name in ALLOC_CONF_NAMES):
        return {}
    return {ALLOC_CONF: "expandable_segments:True"}


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
    ap.add_argument("--nodes", type=int, default=1, help="training nodes (SLURM: one torchrun per node)")
    ap.add_argument("--rdzv-endpoint", default=None, help="c10d rendezvous host:port (default: derived)")
    ap.add_argument("--rdzv-port", type=int, default=None,
                    help="the rendezvous port on the first node (default: derived from the SLURM job id)")
    ap.add_argument("--rdzv-timeout", type=int, default=None,
                    help="seconds the nodes' agents wait for every node to join (default: torchrun's 600)")
    ap.add_argument("--socket-ifname", default=None,
                    help="network interface of the ranks' collectives (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)")
    ap.add_argument("--print-command", action="store_true", help="print the command line(s) and exit")
    args = ap.parse_args(argv[:split])
    cmd = argv[split + 1:]

    def note(message: str) -> None:
        print(f"pipeline.launch: {message}", file=sys.stderr, flush=True)

    devices = None if args.print_command else gpus.acquire(args.gpus, wait_message=note)
    env = dict(os.environ)
    if devices is not None:
        env.update(devices.env())  # the ids, and the order they are numbered in
    if args.train:
        env.update(allocator_env(env))
        terminal = controlling_terminal()
        if terminal:  # rank 0 draws the stage's progress line there (the log keeps its own lines)
            env[PROGRESS_TTY_ENV] = terminal
    cmds = [cmd]
    if args.train:
        nproc = torchrun.processes(args.nproc, devices.ids if devices else gpus.present())
        per_node = len(devices.ids) if devices else int(args.gpus) if args.gpus.isdigit() else 0
        topo = torchrun.topology(args.nodes, nproc, args.rdzv_endpoint, port=args.rdzv_port,
                                 gpus_per_node=per_node, join_timeout_s=args.rdzv_timeout)
        cmds = torchrun.commands(cmd, topo)
        env.update(torchrun.network_env(topo, args.socket_ifname, env))
    if args.print_command:
        print("\n".join(shlex.join(c) for c in cmds))
        return 0
    try:
        return run.run(cmds, args.log, env=env, preemptible=args.train)
    finally:
        if devices is not None:
            devices.release()


if __name__ == "__main__":
    sys.exit(main())
