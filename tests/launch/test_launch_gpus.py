"""GPUs of one machine are handed out so that two jobs never share one (simulated with SFT_GPUS).

`SFT_GPUS=0,1` tells the launcher the machine has two GPUs, ids 0 and 1; each job gets its own
through CUDA_VISIBLE_DEVICES and holds a lock per device while it runs. Its ids are numbered as
nvidia-smi numbers them (CUDA_DEVICE_ORDER=PCI_BUS_ID), so CUDA shows a job the devices it locked.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from kits.train import pipeline_env

# A job that reports the devices it was given, then holds them a while.
_REPORT = "import os, sys, time; print(os.environ.get('CUDA_VISIBLE_DEVICES', '-'), flush=True); time.sleep(float(sys.argv[1]))"


def _start(tmp_path, name: str, gpus: str, hold: float) -> tuple[subprocess.Popen, object]:
    log = tmp_path / f"{name}.log"
    env = pipeline_env({"SFT_GPUS": "0,1", "SFT_GPU_LOCK_DIR": str(tmp_path / "locks")})
    cmd = [sys.executable, "-m", "pipeline.launch", "--log", str(log), "--gpus", gpus, "--",
           sys.executable, "-c", _REPORT, str(hold)]
    return subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True), log


def _output(log) -> list[str]:
    """What the job printed (the launcher's own first line names the command it started)."""
    return [line for line in log.read_text().splitlines() if not line.startswith("pipeline.launch: ")]


def _devices(log) -> set[str]:
    return set(_output(log)[0].split(","))


def test_two_concurrent_jobs_get_disjoint_devices(tmp_path):
    a, log_a = _start(tmp_path, "eval_a", "1", 3.0)
    b, log_b = _start(tmp_path, "eval_b", "1", 3.0)
    assert a.wait(60) == 0 and b.wait(60) == 0
    assert _devices(log_a) | _devices(log_b) == {"0", "1"}
    assert _devices(log_a).isdisjoint(_devices(log_b))


def test_a_training_stage_alone_gets_every_device(tmp_path):
    train, log = _start(tmp_path, "train", "all", 0.1)
    assert train.wait(60) == 0
    assert _devices(log) == {"0", "1"}


def test_a_job_waits_while_its_devices_are_taken(tmp_path):
    evaluation, eval_log = _start(tmp_path, "eval", "1", 4.0)
    time.sleep(1.0)  # the evaluation holds one of the two devices
    started = time.time()
    train, train_log = _start(tmp_path, "train", "all", 0.1)
    assert train.wait(60) == 0 and evaluation.wait(60) == 0
    assert time.time() - started > 2.0  # it waited for the evaluation to give its device back
    assert "waiting for 2 free GPU(s)" in train.stderr.read()
    assert _devices(train_log) == {"0", "1"} and len(_devices(eval_log)) == 1


def test_no_gpus_means_nothing_is_handed_out(tmp_path):
    log = tmp_path / "cpu.log"
    env = pipeline_env({"SFT_GPUS": ""})
    env.pop("CUDA_VISIBLE_DEVICES")  # set empty by tests/conftest.py; unset here, as on a CPU machine
    proc = subprocess.run([sys.executable, "-m", "pipeline.launch", "--log", str(log), "--gpus", "all", "--",
                           sys.executable, "-c", _REPORT, "0"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and _output(log)[0] == "-"  # CUDA_VISIBLE_DEVICES untouched


# A job that reports the devices it was given and the order CUDA numbers them in.
_ORDER = "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES', '-'), os.environ.get('CUDA_DEVICE_ORDER', '-'))"


def _fake_nvidia_smi(tmp_path) -> str:
    """A bin dir whose nvidia-smi lists two GPUs (indices 0 and 1, PCI bus order), for PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '0\\n1\\n'\n")
    smi.chmod(0o755)
    return str(bin_dir)


@pytest.mark.parametrize("listed_by, order", [
    ("nvidia-smi", "PCI_BUS_ID"),  # nvidia-smi's indices are PCI bus order, whatever the user's CUDA order
    ("SFT_GPUS", "PCI_BUS_ID"),
    ("CUDA_VISIBLE_DEVICES", "PCI_BUS_ID"),  # the user's ids, no order chosen: nvidia-smi's numbering
    ("CUDA_VISIBLE_DEVICES with an order", "FASTEST_FIRST"),  # the user's ids in the user's own order
])
def test_a_job_gets_its_devices_numbered_as_they_were_handed_out(tmp_path, listed_by, order):
    env = pipeline_env({"SFT_GPU_LOCK_DIR": str(tmp_path / "locks")})
    env.pop("CUDA_VISIBLE_DEVICES")
    env.pop("SFT_GPUS", None)
    env["CUDA_DEVICE_ORDER"] = "FASTEST_FIRST"  # CUDA's default, set explicitly
    if listed_by == "nvidia-smi":
        env["PATH"] = f"{_fake_nvidia_smi(tmp_path)}{os.pathsep}{env['PATH']}"
    elif listed_by == "SFT_GPUS":
        env["SFT_GPUS"] = "0,1"
        env.pop("CUDA_DEVICE_ORDER")
    else:
        env["CUDA_VISIBLE_DEVICES"] = "0,1"
        if listed_by == "CUDA_VISIBLE_DEVICES":
            env.pop("CUDA_DEVICE_ORDER")
    log = tmp_path / "job.log"
    proc = subprocess.run([sys.executable, "-m", "pipeline.launch", "--log", str(log), "--gpus", "1", "--",
                           sys.executable, "-c", _ORDER], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    visible, seen_order = _output(log)[0].split()
    assert visible in {"0", "1"} and seen_order == order
