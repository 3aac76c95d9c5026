"""Evaluation across ranks: the default validation set on 1 vs 2 ranks (CPU, gloo), same numbers out.

    python bench/bench_eval_ranks.py [--repeats 3]
    python bench/bench_eval_ranks.py --smoke       # 1 repeat, written to a temp dir: checks it runs

The embedded default's model and validation cache (128 records), the default
run's trainer settings, `optim.lr=0` (so both runs hold the very same weights)
and one full evaluation, after the second of 2 updates: raw weights and both EMA rates,
3 passes over the validation set. Each rank runs one torch thread. The eval's
wall time is what the trainer logs in the metrics' eval event; the validation
losses must be equal to the last bit.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def evaluate(root: Path, default: dict, ranks: int, repeat: int) -> dict:
    work = root / f"r{ranks}_{repeat}"
    # 2 updates: a plan needs a pilot and a chunk of at least one update each (then made one stage).
    plan = C.plan_run(work / "plan", default, total=2, single_stage=True, overrides=[
        *C.workflow_overrides(), "optim.lr=0.0", f"{C.KEY_EVAL_EVERY}=2", "checkpoint.save_every=0"])
    train = ["-m", "pipeline", "train", "--plan", str(plan["plan"]), "--config", str(plan["config"]),
             "--stage", "all", "--scratch", str(work / "scratch"), "--out", str(work / "stage")]
    cmd = [sys.executable, *train] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *train]
    C.run_child(cmd, work, threads=1, label=f"{ranks} rank(s)")
    records = [json.loads(x) for x in (work / "stage" / "metrics.jsonl").read_text().splitlines()]
    event = next(r for r in records if r.get("event") == "eval")
    return {"seconds": event["seconds"], "losses": {k: v for k, v in event.items() if k.startswith("val_")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out-dir", type=Path, default=C.RESULTS)
    C.add_smoke(ap)
    args = ap.parse_args()
    C.smoke(args, repeats=1)
    runs: dict[int, list[dict]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory(prefix="bench_eval_ranks_") as tmp:
        root = Path(tmp)
        default = C.build_default(root / "default")
        for repeat in range(args.repeats):
            for ranks in (1, 2):  # interleaved: both see the same machine load
                runs[ranks].append(evaluate(root, default, ranks, repeat))
    seconds = {r: C.median(x["seconds"] for x in runs[r]) for r in runs}
    losses = {r: runs[r][0]["losses"] for r in runs}
    same = all(x["losses"] == losses[1] for r in runs for x in runs[r])
    machine = C.machine()
    md = [
        "# Evaluation across ranks",
        "",
        f"Command: `{C.command_line(__file__)}`",
        f"Machine: {C.machine_text(machine)}",
        "",
        "The default validation set (128 records), raw weights + 2 EMA rates, one torch thread per rank; "
        f"median of {args.repeats} runs each.",
        "",
        "| ranks | eval wall time (s) | validation losses |",
        "|---|---|---|",
        *(f"| {r} | {seconds[r]:.2f} | {', '.join(f'{k[4:]} {v:.6f}' for k, v in losses[r].items())} |"
          for r in runs),
        "",
        f"Speed-up 2 ranks / 1: **{seconds[1] / seconds[2]:.2f}x**; losses "
        f"{'identical to the last bit' if same else 'DIFFER'} on every run.",
    ]
    data = {"command": C.command_line(__file__), "date": C.today(), "machine": machine, "trainer_commit": C.git_commit(),
            "versions": C.versions("torch", "transformers", "peft"),
            "figures": {"seconds": seconds, "speedup": seconds[1] / seconds[2], "identical": same, "losses": losses,
                        "runs": runs}}
    C.write_results("eval_ranks", md, data, args.out_dir)


if __name__ == "__main__":
    main()
