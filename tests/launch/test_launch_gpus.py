"""GPUs of one machine are handed out so that two jobs never share one (simulated with SFT_GPUS).

`SFT_GPUS=0,1` tells the launcher the machine has two GPUs, ids 0 and 1; each job gets its own
through CUDA_VISIBLE_DEVICES and holds a lock per device while it runs.
"""

from __future__ import annotations

import subprocess
import sys
import time

from trainkit import pipeline_env

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
