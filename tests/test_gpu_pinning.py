"""The suite is GPU-safe: a session started with GPUs visible runs its CPU tests on the CPU.

A small pytest session under tests/conftest.py (copied next to a probe test) is started with
CUDA_VISIBLE_DEVICES=0,1 on a simulated GPU host: torch.cuda answers as a CUDA runtime does,
from the devices CUDA_VISIBLE_DEVICES lists. Each probe records what the trainer would pick
(`distributed.setup`'s device, `precision.mode=auto`) and what the processes it starts see.
An unmarked test gets the CPU, fp32 and no devices; a `gpu` test gets the session's devices.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from kits.train import REPO, pipeline_env

PROBE = r'''
import json, os, subprocess, sys

import pytest
import torch

from pipeline import distributed
from pipeline.model import precision


def _cuda_runtime(monkeypatch):
    """torch.cuda as on a host with two GPUs: it sees those CUDA_VISIBLE_DEVICES lists (all when unset)."""
    def visible():
        listed = os.environ.get("CUDA_VISIBLE_DEVICES")
        return 2 if listed is None else len([d for d in listed.split(",") if d.strip()])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible() > 0)
    monkeypatch.setattr(torch.cuda, "device_count", visible)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


def _record(request, monkeypatch):
    _cuda_runtime(monkeypatch)
    device = distributed.setup().device
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"],
                           capture_output=True, text=True, check=True).stdout.strip()
    seen = {"env": os.environ.get("CUDA_VISIBLE_DEVICES"), "child": child, "device": device.type,
            "precision": precision.choose("auto", device).name}
    with open(os.environ["PROBE_OUT"], "a") as f:
        f.write(json.dumps({request.node.name: seen}) + "\n")


def test_cpu_probe(request, monkeypatch):
    _record(request, monkeypatch)


@pytest.mark.gpu
def test_gpu_probe(request, monkeypatch):
    _record(request, monkeypatch)
'''

# The session believes torch sees a GPU (this machine may have none): the `gpu` probe then runs.
# (The copy lives in a package, `suite`: pytest reuses an imported package conftest, patched.)
START = ("import sys, pytest, suite.conftest as c; c.session_has_cuda = lambda: True; "
         "sys.exit(pytest.main(sys.argv[1:]))")


def test_cpu_tests_of_a_session_with_visible_gpus_select_the_cpu(tmp_path):
    root = tmp_path / "suite"
    root.mkdir()
    (root / "__init__.py").write_text("")
    for name in ("conftest.py", "group_seconds.json"):  # the conftest reads the modules' seconds beside it
        shutil.copy(REPO / "tests" / name, root / name)
    (root / "test_probe.py").write_text(PROBE)
    out = tmp_path / "seen.jsonl"
    env = pipeline_env({"CUDA_VISIBLE_DEVICES": "0,1", "PROBE_OUT": str(out)})
    env["PYTHONPATH"] = f"{tmp_path}:{REPO / 'tests'}:{env['PYTHONPATH']}"
    proc = subprocess.run([sys.executable, "-c", START, "-q", "-p", "no:cacheprovider", "-W", "ignore", str(root)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = {k: v for line in out.read_text().splitlines() for k, v in json.loads(line).items()}
    assert seen["test_cpu_probe"] == {"env": "", "child": "", "device": "cpu", "precision": "fp32"}
    # The same probe in a `gpu` test picks CUDA: the simulated host does have GPUs to hide.
    assert seen["test_gpu_probe"] == {"env": "0,1", "child": "0,1", "device": "cuda", "precision": "bf16"}
