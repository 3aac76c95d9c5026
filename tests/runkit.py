"""Running the workflow from tests: copies of it, snakemake calls, and what a run did."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKFLOW_FILES = ("Snakefile", "workflow", "config", "profiles")
# The final adapter of the default run ("demo"): what the equality checks compare.
FINAL_ADAPTER = "results/demo/stages/tail/checkpoint/adapter/adapter_model.safetensors"


def copy_workflow(dest: Path) -> Path:
    """The workflow files without results/: a user's fresh checkout (the package is pip-installed)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_FILES:
        src = REPO / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dest / name)
    return dest


def copy_run(done: Path, dest: Path) -> Path:
    """A copy of a finished run (its workflow, results, logs and snakemake's records, mtimes kept)
    that a test may change without touching the session's shared run."""
    shutil.copytree(done, dest, symlinks=True)
    return dest


def snakemake(workdir: Path, *args: str, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m snakemake *args` in workdir, with no fault injection unless env asks for it."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1")
    full_env.pop("SFT_FAULTS", None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=workdir, capture_output=True,
                          text=True, env=full_env, timeout=timeout)


_JOB_START = re.compile(r"^\s*(?:local)?rule (\w+):\s*$")
_WILDCARD_STAGE = re.compile(r"^\s*wildcards: .*\bstage=(\w+)")


def jobs_in_log(text: str) -> list[tuple[str, str | None]]:
    """(rule, stage or None) for every job snakemake listed (dry run) or ran, in order."""
    jobs: list[tuple[str, str | None]] = []
    for line in text.splitlines():
        if m := _JOB_START.match(line):
            jobs.append((m.group(1), None))
        elif jobs and (m := _WILDCARD_STAGE.match(line)) and jobs[-1][1] is None:
            jobs[-1] = (jobs[-1][0], m.group(1))
    return [j for j in jobs if j[0] != "all"]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
