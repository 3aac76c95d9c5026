"""The command line of a training stage: one process, or torchrun over the job's devices.

With one process the stage runs as `python -m pipeline train ...` directly
(torchrun would add seconds of start-up and nothing else); with more, as
`torchrun --standalone --nproc-per-node N -m pipeline train ...` on this node.
"""

from __future__ import annotations

import sys


def processes(nproc: str, devices: list[str] | None) -> int:
    """Processes per node: `auto` is one per device the job holds (1 without GPUs)."""
    if nproc == "auto":
        return max(1, len(devices or []))
    n = int(nproc)
    if n < 1:
        raise SystemExit(f"pipeline.launch: --nproc must be auto or >= 1, not {nproc}")
    return n


def command(module_args: list[str], nproc: int) -> list[str]:
    """`module_args`: what follows `python` (`-m pipeline train ...`)."""
    if nproc == 1:
        return [sys.executable, *module_args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *module_args]
