"""Every script in bench/ still runs: its `--smoke` mode, as a user runs it, ends 0 and writes its result.

A benchmark is not part of the package, so nothing else notices when a renamed
trainer function, config key or library change breaks one (bench_train.py's TRL
arm was broken for two issues). Each script runs in its own process
(`python bench/<script>.py --smoke --out-dir ...`) on tiny sizes; its figures
measure nothing, only that the whole path (children, clock hooks, report) works.

The runs are the costly part (each starts trainer processes, ~5 s of imports
apiece), so they start together when the module's first test asks, two at a
time, in the order of the selected tests; each test waits for its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
PARALLEL = 2  # concurrent smoke runs: each is mostly one single-threaded process at a time
TIMEOUT_S = 600

# script -> (the option that takes its output path, the files it writes there).
SCRIPTS = {
    "bench_train": ("--out-dir", ["train.json", "train.md"]),
    "bench_packing": ("--out-dir", ["packing.json", "packing.md"]),
    "bench_checkpoint": ("--out-dir", ["checkpoint.json", "checkpoint.md"]),
    "bench_stages": ("--out-dir", ["stages.json", "stages.md"]),
    "bench_gpu": ("--out-dir", ["gpu.json", "gpu.md"]),
    "bench_memory": ("--out-dir", ["memory.json", "memory.md"]),
    "bench_data": ("--out", ["data.md"]),
    "bench_stage_start": ("--out", ["stage_start.md"]),
    "bench_merge": ("--out", ["merge.md"]),
    "bench_fsdp_memory": ("--out-dir", ["fsdp_memory.json", "fsdp_memory.md"]),
    "bench_eval_ranks": ("--out-dir", ["eval_ranks.json", "eval_ranks.md"]),
    "bench_quant": ("--out-dir", ["quant.json", "quant.md"]),
    "bench_step": ("--out-dir", ["step.json", "step.md"]),
    "bench_load": ("--out-dir", ["load.json", "load.md"]),
    "bench_kernels": ("--out-dir", ["kernels.json", "kernels.md"]),
    "bench_host_ops": ("--out-dir", ["host_ops.json", "host_ops.md"]),
    "bench_slurm_nodes": ("--out-dir", ["slurm_nodes.json", "slurm_nodes.md"]),
    "gpu_kernels_check": ("--out", ["kernels_check.json"]),
    "run_all": ("--out", ["RESULTS.md"]),
}


def test_every_script_has_a_smoke_test():
    """A new script in bench/ needs an entry in SCRIPTS (its smoke mode, tested below)."""
    scripts = {p.stem for p in BENCH.glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(SCRIPTS), f"bench/ scripts without a smoke test: {sorted(scripts - set(SCRIPTS))}"


def _committed_results() -> dict[str, str]:
    """Digests of bench/results/* and bench/RESULTS.md: a smoke run must leave them alone."""
    paths = [*sorted((BENCH / "results").glob("*")), BENCH / "RESULTS.md"]
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths if p.is_file()}


def _run(script: str, out: Path) -> dict:
    flag, files = SCRIPTS[script]
    target = out / files[0] if flag == "--out" else out
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, str(BENCH / f"{script}.py"), "--smoke", flag, str(target)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    return {"rc": proc.returncode, "log": proc.stdout[-3000:] + proc.stderr[-5000:],
            "seconds": time.perf_counter() - started}


@pytest.fixture(scope="module")
def smoke_runs(request, tmp_path_factory):
    """script -> future of its smoke run, for the scripts whose tests are selected (in their order)."""
    selected = [item.callspec.params["script"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")]
    before = _committed_results()
    pool = ThreadPoolExecutor(max_workers=PARALLEL)
    outs = {s: tmp_path_factory.mktemp(s) for s in dict.fromkeys(selected)}
    futures = {s: pool.submit(_run, s, out) for s, out in outs.items()}
    yield {s: (futures[s], outs[s], before) for s in futures}
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_smoke(script, smoke_runs, record_property):
    future, out, before = smoke_runs[script]
    run = future.result()
    record_property("smoke_seconds", round(run["seconds"], 1))
    print(f"{script} --smoke: {run['seconds']:.1f} s")
    assert run["rc"] == 0, f"python bench/{script}.py --smoke failed ({run['rc']}):\n{run['log']}"
    _, files = SCRIPTS[script]
    missing = [f for f in files if not (out / f).is_file()]
    assert not missing, f"bench/{script}.py --smoke wrote no {missing} in {out}:\n{run['log']}"
    for f in files:
        text = (out / f).read_text()
        if f.endswith(".json"):
            assert json.loads(text)["smoke"] is True, f"{f}: a smoke run's result is not marked smoke"
        elif script != "run_all":  # run_all's smoke rebuilds RESULTS.md from the committed (real) figures
            assert text.startswith("**Smoke run**"), f"{f}: a smoke run's report does not say so"
    if script == "run_all":
        assert "| figure | value | goal | source |" in (out / "RESULTS.md").read_text()
    assert _committed_results() == before, f"bench/{script}.py --smoke changed bench/results/ or bench/RESULTS.md"
