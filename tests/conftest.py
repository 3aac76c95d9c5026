"""Fixtures shared by the workflow tests (tests/workflow) and the SLURM tests (tests/slurm).

`local_default_run` is the reference the others are compared with: one cold
`snakemake --cores all` of the embedded default in a copy of the workflow, made
once per test session (about 4 minutes on 2 cores).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from runkit import copy_workflow, snakemake


@pytest.fixture(scope="session")
def local_default_run(tmp_path_factory) -> Path:
    """A cold local run of the embedded default, as the README's quickstart does it."""
    workdir = copy_workflow(tmp_path_factory.mktemp("local-run"))
    proc = snakemake(workdir, "--cores", "all")
    assert proc.returncode == 0, proc.stderr[-6000:]
    return workdir
