"""`python -m pipeline status results/<run>`: where every stage of a run is, from files only.

One line per stage of the run's plan (every variant's, in a sweep): done, running
(its own counter, the run's, loss, tokens/s, stage and run ETA, the age of the
last update), stale (no update for --stale-after seconds: stopped, preempted,
waiting for a retry), or waiting. It reads what a running stage leaves in its
scratch dir (`work/<run>/<stage>/status.json`, replaced every few seconds by
rank 0; else the last line of its metrics.jsonl) and the finished stage outputs,
so it works from a SLURM login node while the jobs run elsewhere. Run it in the
directory Snakemake runs in (or pass --work).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pipeline import layout
from pipeline.errors import UserError


def work_dir(run: Path) -> Path:
    """results/<run> -> work/<run> (the scratch root next to results/, as the train rule names it)."""
    parts = run.parts
    if layout.RESULTS not in parts:
        raise UserError(f"{run} is not under a {layout.RESULTS}/ dir: pass the run as {layout.RESULTS}/<run>, or --work")
    i = len(parts) - 1 - parts[::-1].index(layout.RESULTS)
    return Path(*parts[:i], layout.WORK, *parts[i + 1:])


def _age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    m, s = divmod(seconds, 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _eta(seconds) -> str:
    return "?" if seconds is None else _age(seconds)


def _last_metrics(path: Path) -> dict | None:
    """The last update line of a metrics.jsonl (a stage started before status.json existed)."""
    if not path.is_file():
        return None
    for line in reversed(path.read_text(errors="replace").splitlines()):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "loss" in record and "event" not in record:
            return record
    return None


def stage_line(stage: dict, total: int, out: Path, scratch: Path, *, now: float, stale_after: float) -> str:
    """One stage's line: `chunk01  running  21/142 (run 178/300) loss 0.1715 ...`."""
    name, start, end = stage["name"], stage["start"], stage["end"]
    size = end - start
    status = None
    path = scratch / layout.SCRATCH_STATUS
    if path.is_file():
        try:
            status = json.loads(path.read_text())
        except ValueError:
            status = None  # being replaced: os.replace makes this rare; the next call reads it
    if (out / layout.STAGE_CHECKPOINT / layout.MANIFEST_FILE).is_file():
        detail = f"{size}/{size} (run {end}/{total})"
        last = _last_metrics(out / layout.STAGE_METRICS)  # (the scratch dir is gone by now)
        if last is not None:
            detail += f" loss {last['loss']:.4f}"
        return f"{name:<10} {'done':<8} {detail}"
    if status is None:
        last = _last_metrics(scratch / layout.SCRATCH_METRICS)
        if last is None:
            return f"{name:<10} {'waiting':<8}"
        updated = (scratch / layout.SCRATCH_METRICS).stat().st_mtime
        status = {"step": last["step"], "loss": last["loss"], "tokens_per_s": last.get("tokens_per_s"),
                  "updated": updated, "state": "running"}
    step = status["step"]
    age = now - status["updated"]
    state = "stale" if age > stale_after else status.get("state", "running")
    parts = [f"{step - start}/{size} (run {step}/{total})"]
    if status.get("loss") is not None:
        parts.append(f"loss {status['loss']:.4f}")
    if status.get("tokens_per_s") is not None:
        parts.append(f"{status['tokens_per_s']:.0f} tok/s")
    if state != "stale":
        parts.append(f"stage ETA {_eta(status.get('stage_eta_s'))} run ETA {_eta(status.get('run_eta_s'))}")
    parts.append(f"updated {_age(age)} ago" + (f" on {status['host']}" if status.get("host") else ""))
    if state == "stale":
        parts.append("(no update since: stopped, preempted or waiting for a retry?)")
    return f"{name:<10} {state:<8} " + " ".join(parts)


def run_lines(run: Path, work: Path, *, now: float, stale_after: float) -> list[str]:
    """Lines for the run and, in a sweep, each variant (results/<run>/variants/<name>/)."""
    tree = layout.RunTree(run)
    vruns = [(tree, work, None)] if tree.plan.is_file() else []
    for plan in sorted(tree.variants.glob(f"*/{layout.PLAN_FILE}")):
        name = plan.parent.name
        vruns.append((tree.variant(name), work / layout.VARIANTS_DIR / name, name))
    if not vruns:
        raise UserError(f"{tree.plan} not found: the run has not been planned yet (or the path is not a run)")
    lines = []
    for vrun, scratch_root, variant in vruns:
        plan = json.loads(vrun.plan.read_text())
        if variant is not None:
            lines.append(f"variant {variant}:")
        for stage in plan["stages"]:
            lines.append(stage_line(stage, plan["total_updates"], vrun.stage(stage["name"]),
                                    scratch_root / stage["name"], now=now, stale_after=stale_after))
    return lines


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline status", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="the run's results dir, results/<run>")
    ap.add_argument("--work", type=Path, default=None, help="its scratch dir (default: work/<run> beside results/)")
    ap.add_argument("--stale-after", type=float, default=600.0,
                    help="seconds without an update after which a stage counts as stale (default 600)")
    args = ap.parse_args(argv)
    if not args.run.is_dir():
        raise UserError(f"{args.run} is not a directory (run this where Snakemake runs, on results/<run>)")
    work = args.work if args.work is not None else work_dir(args.run)
    print("\n".join(run_lines(args.run, work, now=time.time(), stale_after=args.stale_after)))
    return 0
