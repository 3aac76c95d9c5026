"""The package's import structure, as pyproject.toml's [tool.importlinter] contracts state it.

The same check a developer runs by hand: `lint-imports` in the repository root. Each contract is
also shown to bite: a copy of the package with one planted import that breaks it fails the check.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _lint(root: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is missing: pip install -e '.[dev]' installs import-linter")
    env = {**os.environ, "PYTHONPATH": str(root)}  # this tree's `pipeline`, not the installed one
    return subprocess.run([exe, "--no-cache"], cwd=root, capture_output=True, text=True, env=env)


def test_the_contracts_hold():
    proc = _lint(REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lint")
    shutil.copytree(REPO / "pipeline", root / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root)
    return root


@pytest.mark.parametrize("module, planted", [
    ("pipeline/data/cache.py", "import pipeline.model.loss"),  # an upward import (layers)
    ("pipeline/train/ema.py", "import pipeline.evaluate.metrics"),  # train and evaluate stay apart
    ("pipeline/layout.py", "import pipeline.config"),  # a cycle through the bottom layer
    ("pipeline/planning/schedule.py", "import torch"),  # the Snakefile's imports stay light
    ("pipeline/planning/run_config.py", "import pipeline.model.memory"),  # torch, one module away
    ("pipeline/launch/run.py", "import transformers"),
    ("pipeline/planning/benchmarks.py", "import lm_eval"),  # lm-eval only in the benchmark jobs
    ("pipeline/data/tokenize.py", "import peft"),  # data needs no model library
])
def test_a_planted_import_breaks_the_check(tree, module, planted):
    path = tree / module
    original = path.read_text()
    try:
        path.write_text(original + f"\n{planted}  # planted by the test\n")
        proc = _lint(tree)
    finally:
        path.write_text(original)
    assert proc.returncode != 0, f"{planted} in {module} went unnoticed:\n{proc.stdout[-3000:]}"
    assert _lint(tree).returncode == 0  # and the copy is clean again
