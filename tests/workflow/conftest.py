"""Shared by the workflow tests: one cold run of the default pipeline for the whole session.

`done` runs `snakemake --cores all` once in a copy of the workflow (about 4-5 minutes on
2 cores); test_pipeline.py and test_report.py both read it. `run_snakemake(workdir, *args)`
runs snakemake there as a user would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _snakemake(workdir: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("SFT_FAULTS", None)
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=workdir, capture_output=True,
                          text=True, env=env, timeout=timeout)


def _copy_workflow(dest: Path) -> Path:
    for name in ("Snakefile", "workflow", "config", "profiles"):
        src = REPO / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dest / name)
    return dest


@pytest.fixture(scope="session")
def run_snakemake():
    """`run_snakemake(workdir, *args, timeout=900)`: `python -m snakemake *args` in workdir."""
    return _snakemake


@pytest.fixture(scope="session")
def done(tmp_path_factory) -> Path:
    """A cold run of the embedded default in a copy of the workflow (shared by the session)."""
    workdir = _copy_workflow(tmp_path_factory.mktemp("wf"))
    proc = _snakemake(workdir, "--cores", "all")
    assert proc.returncode == 0, proc.stderr[-6000:]
    return workdir
