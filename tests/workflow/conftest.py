"""Shared by the workflow tests: the session's cold run of the default pipeline.

`done` is `local_default_run` (tests/conftest.py), also the SLURM tests' reference;
test_pipeline.py and test_report.py both read it. `run_snakemake(workdir, *args)`
runs snakemake there as a user would.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kits.run import snakemake


@pytest.fixture(scope="session")
def run_snakemake():
    """`run_snakemake(workdir, *args, timeout=900)`: `python -m snakemake *args` in workdir."""
    return snakemake


@pytest.fixture(scope="session")
def done(local_default_run) -> Path:
    """A cold run of the embedded default in a copy of the workflow (shared by the session)."""
    return local_default_run
