"""The workflow's load: `snakemake -n -q` of the default config, this tree against an earlier commit.

    python bench/bench_load.py                   # 5 rounds, against cf805b0 (before issue 34)
    python bench/bench_load.py --before <rev>    # another commit
    python bench/bench_load.py --smoke           # 1 round: checks it runs

Every `snakemake` call loads the Snakefile, and so does every cluster job: what
it imports and resolves there is paid each time. Each arm is a fresh copy of
the workflow files (Snakefile, workflow/, config/, profiles/, as a user's
checkout) with the embedded default config, run as `python -m snakemake -n -q
--cores 1` in a fresh process whose `pipeline` is that arm's: `before` a `git
archive` of the given commit, `after` this tree. The arms are interleaved and
their order rotated every round; figures are medians over rounds: wall clock,
the process's CPU time (user + system, less moved by other jobs on a shared
machine) and peak RSS (`os.wait4`), and whether torch was imported (the
process lists `sys.modules` after the dry run).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

ARMS = ("before", "after")
WORKFLOW_FILES = ("Snakefile", "workflow", "config", "profiles")
HEAVY = ("torch", "transformers", "peft")
# A dry run as `python -m snakemake` makes it; at exit, the heavy libraries it loaded (the last line).
DRY_RUN = ("import atexit, sys; from snakemake.cli import main; "
           f"atexit.register(lambda: print('HEAVY=' + ','.join(m for m in {HEAVY!r} if m in sys.modules))); "
           "main(sys.argv[1:])")


def _tree(rev: str | None, root: Path) -> Path:
    """The package and workflow files of `rev` (None: this tree) in `root`."""
    if rev is None:
        root.mkdir(parents=True)
        shutil.copytree(C.REPO / "pipeline", root / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
        for name in WORKFLOW_FILES:
            src = C.REPO / name
            (shutil.copytree if src.is_dir() else shutil.copy2)(src, root / name)
        return root
    return C.git_tree(rev, root, ["pipeline", *WORKFLOW_FILES], "the 'before' tree")


def _dry_run(tree: Path) -> dict:
    """One `snakemake -n -q` in `tree` with its own `pipeline`: wall s, CPU s, peak RSS MiB, heavy modules."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", DRY_RUN, "-n", "-q", "--cores", "1"], cwd=tree, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"snakemake -n failed in {tree} ({proc.returncode}):\n{out[-3000:]}")
    heavy = next(line for line in out.splitlines() if line.startswith("HEAVY=")).removeprefix("HEAVY=")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "rss_mb": usage.ru_maxrss / 1024,
            "heavy": [m for m in heavy.split(",") if m]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="cf805b0", help="the commit to compare with (git archive)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out-dir", type=Path, default=C.RESULTS)
    C.add_smoke(ap)
    args = ap.parse_args()
    C.smoke(args, rounds=1)

    work = Path(tempfile.mkdtemp(prefix="bench_load_"))
    try:
        trees = {"before": _tree(args.before, work / "before"), "after": _tree(None, work / "after")}
        for arm in ARMS:  # warm-up: byte-compile each tree, fill the OS file cache
            _dry_run(trees[arm])
        runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        load_start = C.load_average()
        for r in range(args.rounds):
            for arm in ARMS[r % 2:] + ARMS[:r % 2]:
                runs[arm].append(_dry_run(trees[arm]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    figures = {arm: {key: C.median([run[key] for run in runs[arm]]) for key in ("wall_s", "cpu_s", "rss_mb")}
               for arm in ARMS}
    for arm in ARMS:
        figures[arm]["heavy"] = sorted({m for run in runs[arm] for m in run["heavy"]})
    machine = C.machine()
    md = [
        "# The workflow's load: `snakemake -n -q`, default config",
        "",
        f"Command: `{C.command_line(__file__)}`",
        f"Machine: {C.machine_text(machine)}; load average {load_start} when the rounds started, "
        f"{C.load_average()} at the end",
        "",
        f"before = `git archive {args.before}`, after = this tree ({C.git_commit() or 'uncommitted'}); each a fresh "
        f"copy of the workflow files with its own `pipeline`; median of {args.rounds} rounds (interleaved, order "
        "rotated), one warm-up run each.",
        "",
        "| arm | wall (s), median | min..max | CPU time (s), median | peak RSS (MiB), median | heavy modules imported |",
        "|---|---|---|---|---|---|",
        *(f"| {arm} | {figures[arm]['wall_s']:.2f} | {min(r['wall_s'] for r in runs[arm]):.2f}.."
          f"{max(r['wall_s'] for r in runs[arm]):.2f} | {figures[arm]['cpu_s']:.2f} | {figures[arm]['rss_mb']:.0f} | "
          f"{', '.join(figures[arm]['heavy']) or 'none'} |" for arm in ARMS),
        "",
        f"after / before: wall {figures['after']['wall_s'] / figures['before']['wall_s']:.2f}x, CPU time "
        f"{figures['after']['cpu_s'] / figures['before']['cpu_s']:.2f}x, peak RSS "
        f"{figures['after']['rss_mb'] / figures['before']['rss_mb']:.2f}x.",
    ]
    data = {"name": "load", "command": C.command_line(__file__), "date": C.today(), "commit": C.git_commit(),
            "machine": machine, "versions": C.versions("snakemake", "torch"), "before": args.before,
            "rounds": args.rounds, "figures": figures, "per_round": runs}
    C.write_results("load", md, data, args.out_dir)


if __name__ == "__main__":
    main()
