"""Running the workflow from tests: copies of it, snakemake calls, and what a run did."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKFLOW_FILES = ("Snakefile", "workflow", "config", "profiles")
# The final adapter of the default run ("demo"): what the equality checks compare.
FINAL_ADAPTER = "results/demo/stages/tail/checkpoint/adapter/adapter_model.safetensors"
# Where the embedded default's base model and dataset live in a workflow copy (rule prepare_base).
EMBEDDED_RESULTS = Path("results") / "embedded"


def copy_workflow(dest: Path) -> Path:
    """The workflow files without results/: a user's fresh checkout (the package is pip-installed)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_FILES:
        src = REPO / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dest / name)
    return dest


def seed_embedded_base(workdir: Path, base: Path) -> Path:
    """workdir with a copy of a prepared embedded base (conftest's `embedded_base`: results/embedded/,
    mtimes kept), which snakemake then takes as its `prepare_base` job's outputs, done."""
    shutil.copytree(base, workdir / EMBEDDED_RESULTS)
    return workdir


def copy_run(done: Path, dest: Path) -> Path:
    """A copy of a finished run (its workflow, results, logs and snakemake's records, mtimes kept)
    that a test may change without touching the session's shared run."""
    shutil.copytree(done, dest, symlinks=True)
    return dest


def snakemake(workdir: Path, *args: str, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m snakemake *args` in workdir, with no fault injection unless env asks for it."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1")
    full_env.pop("SFT_FAULTS", None)
    full_env["SFT_PROGRESS"] = "0"  # no progress line on the terminal pytest may run in
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=workdir, capture_output=True,
                          text=True, env=full_env, timeout=timeout)


_JOB_START = re.compile(r"^\s*(?:local)?(?:rule|checkpoint) (\w+):\s*$")
_WILDCARDS = re.compile(r"^\s*wildcards: (.*)$")


def jobs_with_wildcards(text: str) -> list[tuple[str, dict[str, str]]]:
    """(rule, its wildcards) for every job snakemake listed (dry run) or ran, in order."""
    jobs: list[tuple[str, dict[str, str]]] = []
    for line in text.splitlines():
        if m := _JOB_START.match(line):
            jobs.append((m.group(1), {}))
        elif jobs and (m := _WILDCARDS.match(line)) and not jobs[-1][1]:
            jobs[-1][1].update(item.split("=", 1) for item in m.group(1).split(", "))
    return [j for j in jobs if j[0] != "all"]


def jobs_in_log(text: str) -> list[tuple[str, str | None]]:
    """(rule, stage or None) for every job snakemake listed (dry run) or ran, in order."""
    return [(rule, wildcards.get("stage")) for rule, wildcards in jobs_with_wildcards(text)]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
