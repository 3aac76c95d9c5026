"""Benchmark: what an intra-stage checkpoint save costs the step loop, sync vs async.

    python bench/bench_checkpoint.py               # 60 updates, a save every 10, 3 rounds (~3 min on 2 cores)
    python bench/bench_checkpoint.py --save-every 5 --rounds 5
    python bench/bench_checkpoint.py --smoke       # 5 updates, a save every 2, 1 round: checks it runs

Three configurations of the default run (embedded default model, EMA with 2
rates), interleaved and rotated every round:

* none:  `checkpoint.save_every=0` (only the stage-final checkpoint);
* sync:  `checkpoint.save_every=K checkpoint.async_save=false`;
* async: `checkpoint.save_every=K checkpoint.async_save=true` (the default).

A save gathers CPU copies of all loop state on the training thread (the
snapshot), then writes the files, fsyncs them, checksums them into the
MANIFEST and renames the dir; `async_save` does the writing on a background
thread. Measured, through the clock hooks of bench/_ours.py:

* stall: how long each save holds the loop (snapshot + `AsyncWriter.submit`);
* write: how long the write itself takes (wall, and that thread's CPU time);
* the added time per save seen by the step loop: (mean update time with saves
  - mean update time without) x K, on the wall clock and on the process CPU
  clock (the writer thread's CPU is in the latter, wherever it runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def _run(run: dict, work: Path, threads: int) -> dict:
    work.mkdir(parents=True)
    result = work / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(Path(__file__).resolve().parent / "_ours.py"), str(result), "--plan", str(run["plan"]),
           "--config", str(run["config"]), "--stage", "all", "--scratch", str(work / "scratch"),
           "--out", str(work / "out")]
    load = C.run_child(cmd, work, threads, work.name)
    r = json.loads(result.read_text())
    r["load"] = load[0] if load else None
    r["checkpoint_bytes"] = sum(p.stat().st_size for p in (work / "out" / "checkpoint").rglob("*") if p.is_file())
    return r


def _summarize(r: dict, warmup: int) -> dict:
    ends = r["step_end"][warmup:]
    wall = [b[0] - a[0] for a, b in zip(ends, ends[1:])]
    cpu = [b[1] - a[1] for a, b in zip(ends, ends[1:])]
    # The last save is the stage-final one, after the loop. The first save of a process allocates enough
    # to trigger a full (gen 2) garbage collection over everything setup left behind
    # (0.1-0.5 s here): shown apart, the median of the others is the steady cost.
    saves, writes = r["save_stall"][:-1], r["write"][:-1]
    return {"mean_wall": sum(wall) / len(wall), "mean_cpu": sum(cpu) / len(cpu), "median_wall": C.median(wall),
            "saves": len(saves), "stall_first": saves[0] if saves else 0.0,
            "stall": C.median(saves[1:]) if len(saves) > 1 else 0.0,
            "write_wall": C.median(w[0] for w in writes[1:]) if len(writes) > 1 else 0.0,
            "write_cpu": C.median(w[1] for w in writes[1:]) if len(writes) > 1 else 0.0,
            "stalls_ms": [round(1000 * x, 1) for x in saves],
            "load": r["load"], "checkpoint_bytes": r["checkpoint_bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5, help="updates excluded at the start of every run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every run")
    ap.add_argument("--out-dir", type=Path, default=C.RESULTS)
    C.add_smoke(ap)
    args = ap.parse_args()
    machine = C.machine()  # before we load the cores ourselves (imports torch: after --help)
    C.smoke(args, steps=5, save_every=2, warmup=1, rounds=1)  # 2 saves in the loop: one after the first
    assert args.warmup < args.save_every, "the first save must fall inside the measured updates"

    started = time.time()
    k = args.save_every
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as tmp:
        tmp = Path(tmp)
        default = C.build_default(tmp / "default")
        base = C.workflow_overrides()
        configs = {
            "none": [*base, "checkpoint.save_every=0"],
            "sync": [*base, f"checkpoint.save_every={k}", "checkpoint.async_save=false", "checkpoint.keep_last=2"],
            "async": [*base, f"checkpoint.save_every={k}", "checkpoint.async_save=true", "checkpoint.keep_last=2"],
        }
        runs = {n: C.plan_run(tmp / f"plan_{n}", default, total=args.steps, overrides=o, single_stage=True)
                for n, o in configs.items()}
        names = list(configs)
        results: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names[r % 3:] + names[:r % 3]:
                s = _summarize(_run(runs[name], tmp / f"r{r}_{name}", args.threads), args.warmup)
                results[name].append(s)
                print(f"round {r + 1}/{args.rounds} {name:5s} update {1000 * s['mean_wall']:6.1f} ms wall "
                      f"{1000 * s['mean_cpu']:6.1f} ms CPU  stall {1000 * s['stall']:6.1f} ms  "
                      f"write {1000 * s['write_wall']:6.1f} ms  load {s['load']}", file=sys.stderr, flush=True)
    _report(args, machine, results, time.time() - started)


def _report(args, machine, results, wall) -> None:
    k = args.save_every
    rounds = range(args.rounds)
    med = {n: {key: C.median(r[key] for r in rs) for key in rs[0] if key not in ("load", "stalls_ms")}
           for n, rs in results.items()}
    added = {(n, clock): [k * (results[n][i][f"mean_{clock}"] - results["none"][i][f"mean_{clock}"]) for i in rounds]
             for n in ("sync", "async") for clock in ("wall", "cpu")}
    step = med["none"]["median_wall"]
    figures = {n: {"stall_ms": 1000 * med[n]["stall"], "first_stall_ms": 1000 * med[n]["stall_first"],
                   "write_ms": 1000 * med[n]["write_wall"],
                   "write_cpu_ms": 1000 * med[n]["write_cpu"],
                   "added_wall_ms": 1000 * C.median(added[n, "wall"]), "added_cpu_ms": 1000 * C.median(added[n, "cpu"]),
                   "stall_steps": med[n]["stall"] / step} for n in ("sync", "async")}
    figures["step_ms"] = 1000 * step
    figures["checkpoint_mb"] = med["none"]["checkpoint_bytes"] / 2**20
    loads = [r["load"] for rs in results.values() for r in rs if r["load"] is not None]
    versions = C.versions("torch", "transformers", "peft", "safetensors")
    command = C.command_line(__file__)
    data = {"name": "checkpoint", "command": command, "date": C.today(), "machine": machine, "versions": versions,
            "trainer_commit": C.git_commit(), "wall_s": wall, "load_during": [min(loads), max(loads)],
            "settings": {"steps": args.steps, "save_every": k, "warmup": args.warmup, "rounds": args.rounds,
                         "threads": args.threads},
            "figures": figures, "per_round": results}
    lines = [
        "# Checkpoint save: cost to the step loop, sync vs async",
        "",
        f"Command: `{command}` (from the repository root); {C.today()}; {wall / 60:.1f} min in all.",
        "",
        f"Machine: {C.machine_text(machine)}; load average during the runs {min(loads):.1f}..{max(loads):.1f}.",
        f"Versions: {C.versions_text(versions)}; trainer at commit {data['trainer_commit']}.",
        "",
        f"Run: the default run's trainer settings (EMA with 2 rates) on the embedded default model, fp32 CPU, "
        f"{args.threads} thread(s); {args.steps} updates, a checkpoint every {k} "
        f"({med['sync']['saves']:.0f} saves inside the measured updates; the first {args.warmup} updates excluded). "
        f"One checkpoint (adapter, 2 EMA shadows, optimizer, RNG, config, MANIFEST) is "
        f"{figures['checkpoint_mb']:.2f} MiB. Steady-state update: {figures['step_ms']:.0f} ms. "
        f"{args.rounds} rounds, none / sync / async interleaved and rotated; medians.",
        "",
        "| mode | loop stall per save | first save of the process | write (wall) | write CPU, on the writer "
        "thread when async | stall in updates | stall at save_every=50, % of step time |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n in ("sync", "async"):
        f = figures[n]
        per_round = ", ".join(f"{1000 * r['stall']:.0f}" for r in results[n])
        lines.append(f"| {n}{' (default)' if n == 'async' else ''} | {f['stall_ms']:.1f} ms "
                     f"(rounds {per_round}) | "
                     f"{f['first_stall_ms']:.0f} ms | {f['write_ms']:.1f} ms | {f['write_cpu_ms']:.1f} ms | "
                     f"{f['stall_steps']:.2f} | {100 * f['stall_ms'] / (50 * figures['step_ms']):.2f}% |")
    lines += [
        "",
        "Loop stall: from the start of the save (snapshot of all loop state to CPU) until the loop may go on, "
        "median over the saves after the first (the first save of a process triggers a full, gen 2, garbage "
        "collection over the objects model setup left behind, and is shown apart). Sync includes the whole "
        "write (files, fsync, sha256 MANIFEST, rename); async only the snapshot and the hand-over to the writer "
        "thread. The async write's CPU time (the write CPU column) still runs on the same cores: it is free "
        "while a core is idle and costs the loop up to that much when both are busy. The fsync part of the "
        "write waits on the disk, which other jobs share too, hence the spread of the sync stall across rounds. "
        "A direct A/B of mean update times with and without saves is in checkpoint.json (`added_*`), but on this "
        "shared machine its noise (+-1 s per save) swamps the effect.",
    ]
    C.write_results("checkpoint", lines, data, args.out_dir)


if __name__ == "__main__":
    main()
