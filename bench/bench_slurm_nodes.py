"""What the 2-node SLURM whole-DAG run costs: the default pipeline through the test cluster, 1 node vs 2.

    python bench/bench_slurm_nodes.py            # as root: starts tests/slurm/cluster.sh, ~12 min
    python bench/bench_slurm_nodes.py --smoke    # dry runs of each arm (no cluster): checks it runs

Each arm is a fresh copy of the workflow set up as the SLURM tests set up theirs (tests/kits/slurm.py:
the workflow's partitions and accounts, rendezvous and collective timeouts of 60 s), run
with `snakemake --profile tests/slurm/profile --workflow-profile profiles/default` through
tests/slurm/snakemake_poll.py. The arms:

  1 node            train.nodes=1: every training stage one process on one node
  2 nodes           train.nodes=2: every training stage a 2-node job (what the SLURM tests run)
  2 nodes, backoff  the same with the plugin's own poll backoff (SLURM_TEST_POLL_CAP_S=0), as the tests
                    ran before snakemake_poll.py

For each: the whole run's wall time, and each training job's time from the start of the job (its
first `Date:` line in the plugin's log) to its log's last write. The machine's 2 cores are shared by
both "nodes", so the 2-node figures are a test cost, not a cluster's.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
from kits.slurm import clean_env, slurm_workdir  # noqa: E402  (the SLURM tests' own set-up)

SLURM_TESTS = REPO / "tests/slurm"
ARMS = {"1 node": (1, "2"), "2 nodes": (2, "2"), "2 nodes, plugin backoff": (2, "0")}


def env(cap: str) -> dict[str, str]:
    return clean_env({"SLURM_TEST_POLL_CAP_S": cap, "OMP_NUM_THREADS": "1", "SFT_PROGRESS": "0"})


def training_jobs(workdir: Path) -> dict[str, float]:
    """stage -> seconds of its training job (first `Date:` of the job's log to the log's last write)."""
    jobs = {}
    for log in sorted((workdir / ".snakemake/slurm_logs/rule_train_stage").rglob("*.log")):
        started = re.search(r"Date: (\S+ \S+)", log.read_text())
        if started:
            t0 = datetime.datetime.strptime(started.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
            jobs[log.parent.name.rpartition("_")[2]] = log.stat().st_mtime - t0
    return jobs


def run_arm(root: Path, name: str, dry: bool) -> dict:
    nodes, cap = ARMS[name]
    workdir = slurm_workdir(root / re.sub(r"\W+", "-", name), nodes)
    cmd = [sys.executable, str(SLURM_TESTS / "snakemake_poll.py"), "--profile", str(SLURM_TESTS / "profile"),
           "--workflow-profile", "profiles/default", *(["-n"] if dry else [])]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=workdir, env=env(cap), capture_output=True, text=True, timeout=2400)
    seconds = time.monotonic() - t0
    if proc.returncode:
        raise SystemExit(f"{name}: snakemake failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    jobs = {} if dry else training_jobs(workdir)
    print(f"{name}: {seconds:.0f} s; training jobs {jobs}", file=sys.stderr)
    return {"arm": name, "nodes": nodes, "poll_cap_s": float(cap), "wall_s": seconds, "training_jobs_s": jobs}


def report(rows: list[dict], args) -> list[str]:
    stages = ("pilot", "chunk01", "chunk02", "tail")
    lines = [
        f"# The SLURM whole-DAG run on the test cluster, 1 node vs 2 ({C.today()})", "",
        f"`{C.command_line(__file__)}` at commit {C.git_commit()}. {C.machine_text(C.machine())}",
        "", "The default pipeline through `tests/slurm/profile` (see the script's docstring). Seconds:", "",
        "| arm | whole run | " + " | ".join(f"{s} job" for s in stages) + " | training jobs |",
        "|---|---:|" + "---:|" * (len(stages) + 1),
    ]
    for r in rows:
        jobs = r["training_jobs_s"]
        per_stage = " | ".join(f"{jobs.get(s, float('nan')):.0f}" for s in stages)
        lines.append(f"| {r['arm']} | {r['wall_s']:.0f} | {per_stage} | {sum(jobs.values()):.0f} |")
    by = {r["arm"]: r for r in rows}
    if {"1 node", "2 nodes"} <= set(by):
        in_jobs = sum(by["2 nodes"]["training_jobs_s"].values()) - sum(by["1 node"]["training_jobs_s"].values())
        lines += ["", f"2 nodes add {by['2 nodes']['wall_s'] - by['1 node']['wall_s']:.0f} s to the whole run "
                      f"({in_jobs:.0f} s in the training jobs)."]
    if {"2 nodes", "2 nodes, plugin backoff"} <= set(by):
        lines += [f"Capping the plugin's poll backoff at 2 s saves "
                  f"{by['2 nodes, plugin backoff']['wall_s'] - by['2 nodes']['wall_s']:.0f} s of the 2-node run."]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=C.RESULTS)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    C.add_smoke(ap)
    args = ap.parse_args()
    dry = C.smoke(args)
    if not dry and os.geteuid() != 0:
        raise SystemExit("the test cluster needs root (tests/slurm/cluster.sh)")
    cluster = ["bash", str(SLURM_TESTS / "cluster.sh")]
    if not dry:
        subprocess.run([*cluster, "start"], check=True, env={**env("2"), "SLURM_TEST_FAKE_GPUS": "2"})
    try:
        with tempfile.TemporaryDirectory(prefix="bench_slurm_") as tmp:
            rows = [run_arm(Path(tmp), name, dry) for name in args.arms]
    finally:
        if not dry:
            subprocess.run([*cluster, "stop"], env=env("2"))
    data = {"rows": rows, "trainer_commit": C.git_commit(), "machine": C.machine(), "date": C.today(),
            "command": C.command_line(__file__)}
    C.write_results("slurm_nodes", report(rows, args), data, args.out_dir)


if __name__ == "__main__":
    main()
