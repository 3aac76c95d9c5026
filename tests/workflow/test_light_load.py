"""Loading the workflow imports no torch (STYLE 20): `snakemake -n` of the default config, and every
cluster job (each loads the Snakefile again), only read configs and plan.

The dry run runs as `python -m snakemake` does, in a fresh process that then lists the heavy
libraries in its `sys.modules`. The import-linter contract (pyproject.toml, tests/test_imports.py)
checks the modules the Snakefile imports by name; this checks what a real load pulls in, through
snakemake itself, the rule files and everything they import.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from kits.run import copy_workflow

pytestmark = pytest.mark.workflow

HEAVY = ("torch", "transformers", "peft")
DRY_RUN = f"""
import sys
from snakemake.cli import main
try:
    main(sys.argv[1:])
except SystemExit as done:
    code = done.code
print("heavy modules loaded:", sorted(m for m in {HEAVY!r} if m in sys.modules))
sys.exit(code)
"""


def test_a_dry_run_of_the_default_config_imports_no_torch(tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    proc = subprocess.run([sys.executable, "-c", DRY_RUN, "-n", "--cores", "1"], cwd=workdir, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "train_stage" in out, out[-3000:]  # it planned the whole run
    assert "heavy modules loaded: []" in out, out[-3000:]
