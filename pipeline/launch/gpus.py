"""GPUs of one machine, handed out so that two jobs never share a device.

Snakemake's local executor knows how many GPUs a job asks for (`resources:
gpu`) but not which ones, so two jobs would both land on device 0. Here each
job takes devices from those present and holds an exclusive `flock` on one
lock file per device for as long as it runs; the kernel drops the lock when
the process ends, however it ends, so a killed job never leaves a device
taken. A job that asks for more than is free waits (taking nothing meanwhile,
so two waiting jobs cannot deadlock).

Which devices are present: `SFT_GPUS` (a comma-separated list of device ids;
how tests simulate GPUs on a CPU machine), else `CUDA_VISIBLE_DEVICES`, else
what `nvidia-smi` lists, else none (a CPU machine: nothing to hand out).
Under SLURM the job's allocation is already its own (SLURM sets
`CUDA_VISIBLE_DEVICES`), so there is nothing to lock there.

Device ids are nvidia-smi's, which numbers GPUs by PCI bus, while CUDA numbers
them fastest first unless `CUDA_DEVICE_ORDER=PCI_BUS_ID`: on a machine with
mixed GPUs, id 0 would be another device to CUDA than to the locks, and a job
could run on a GPU another job holds. So a job is handed its ids with
`CUDA_DEVICE_ORDER=PCI_BUS_ID`, unless the ids are the user's own
(`CUDA_VISIBLE_DEVICES`) and the user chose an order for them too.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import tempfile
import time
from pathlib import Path

ENV_SIMULATED = "SFT_GPUS"
ENV_LOCK_DIR = "SFT_GPU_LOCK_DIR"
ENV_ORDER = "CUDA_DEVICE_ORDER"
PCI_ORDER = "PCI_BUS_ID"  # nvidia-smi's numbering
POLL_SECONDS = 2.0


def present() -> list[str]:
    """Device ids this machine (or this job's allocation) has, in order."""
    return _present()[0]


def _present() -> tuple[list[str], str]:
    """(device ids, the CUDA_DEVICE_ORDER they are numbered in)."""
    for var in (ENV_SIMULATED, "CUDA_VISIBLE_DEVICES"):
        value = os.environ.get(var)
        if value is not None:
            ids = [d.strip() for d in value.split(",") if d.strip() and d.strip() != "-1"]
            return ids, os.environ.get(ENV_ORDER) or PCI_ORDER
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return [], PCI_ORDER
    ids = [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []
    return ids, PCI_ORDER


def _lock_dir() -> Path:
    # One directory per machine and user: jobs of every workflow on this machine share it.
    root = Path(os.environ.get(ENV_LOCK_DIR) or Path(tempfile.gettempdir()) / f"sft-pipeline-gpus-{os.getuid()}")
    root.mkdir(parents=True, exist_ok=True)
    return root


class Devices:
    """The devices a job holds; `release()` (or the process ending) gives them back."""

    def __init__(self, ids: list[str], handles: list, order: str = PCI_ORDER):
        self.ids, self._handles, self.order = ids, handles, order

    @property
    def visible(self) -> str:
        return ",".join(self.ids)

    def env(self) -> dict[str, str]:
        """What the job's environment needs so that CUDA shows it these devices, and only these."""
        return {"CUDA_VISIBLE_DEVICES": self.visible, ENV_ORDER: self.order}

    def release(self) -> None:
        for handle in self._handles:
            handle.close()  # closing the file drops its flock
        self._handles = []


def acquire(want: str, *, wait_message=None) -> Devices | None:
    """Take `want` devices ('all', a count, or '0'); None when there is nothing to hand out.

    Waits while fewer are free. Under SLURM, returns the allocation without locking.
    """
    devices, order = _present()
    if want in ("0", "") or not devices:
        return None
    count = len(devices) if want == "all" else int(want)
    if count > len(devices):
        raise SystemExit(f"pipeline.launch: the job asks for {count} GPU(s), this machine has {len(devices)} "
                         f"({','.join(devices)}); lower the request or run where there are more")
    if os.environ.get("SLURM_JOB_ID"):
        return Devices(devices[:count], [], order)
    root, announced = _lock_dir(), False
    while True:
        taken = _try_take(root, devices, count, order)
        if taken is not None:
            return taken
        if not announced and wait_message is not None:
            wait_message(f"waiting for {count} free GPU(s) of {','.join(devices)}")
            announced = True
        time.sleep(POLL_SECONDS)


def _try_take(root: Path, devices: list[str], count: int, order: str) -> Devices | None:
    """Lock `count` free devices at once, or none (all-or-nothing: no hold-and-wait)."""
    ids, handles = [], []
    for device in devices:
        handle = open(root / f"gpu{device}.lock", "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        ids.append(device)
        handles.append(handle)
        if len(ids) == count:
            return Devices(ids, handles, order)
    for handle in handles:
        handle.close()
    return None

