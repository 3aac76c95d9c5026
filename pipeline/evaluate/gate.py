"""The pilot gate: sanity checks on the pilot stage before the long run starts.

    python -m pipeline pilot-gate --pilot results/<run>/stages/pilot --plan plan.json \
        --out results/<run>/pilot_report.json [--override]

Checks (all evaluated, all reported):
  loss_finite      every logged pilot loss is finite
  loss_falling     mean loss of the last third of the pilot < mean of the first third
  grads_flowing    gradient norms are non-zero and the trained weights moved
                   (LoRA B matrices start at zero, so a still-zero B means no gradient reached it)
  no_skipped       no update of the pilot was skipped for a non-finite gradient
  ranks_consistent every rank ended the pilot with the same weights (the trainer
                   compares per-rank checksums and records it; trivially true for one process)
  throughput       tokens/s was measured; the ETA of the whole run follows from it
Every check reads the pilot's training loss, never a validation loss, so a run
without a validation set (``data.val: null``) is gated the same way; its report
then says so (`skipped.NO_VAL`, `skipped.GATE_BASIS` under ``skipped`` / ``judged_on``).
The report is written either way. If a check fails the command exits non-zero,
so no chunk starts, unless `--override` (config: gate.override: true) is given.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from pipeline import layout
from pipeline.checkpoint.reader import open_checkpoint
from pipeline.errors import UserError
from pipeline.evaluate.skipped import GATE_BASIS, NO_VAL, SKIPPED_KEY

EXIT = layout.EXIT_GATE


def _records(metrics_path: Path) -> list[dict]:
    return [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]


def run_checks(pilot_dir: Path, plan: dict) -> dict:
    records = _records(pilot_dir / layout.STAGE_METRICS)
    rows = [r for r in records if "loss" in r]
    checks: dict[str, dict] = {}
    losses = [r["loss"] for r in rows]
    bad = [r["step"] for r in rows if not math.isfinite(r["loss"])]
    checks["loss_finite"] = {"ok": bool(rows) and not bad,
                             "detail": f"non-finite loss at updates {bad[:10]}" if bad else f"{len(rows)} finite losses"}
    third = max(1, len(losses) // 3)
    first, last = statistics.fmean(losses[:third]), statistics.fmean(losses[-third:])
    checks["loss_falling"] = {"ok": last < first, "first_third_mean": first, "last_third_mean": last,
                              "detail": f"mean loss {first:.4f} (first third) -> {last:.4f} (last third)"}
    checkpoint = open_checkpoint(pilot_dir / layout.STAGE_CHECKPOINT)
    main = checkpoint.main  # HF dirs or FSDP shards
    lora_b = [t for _, t in main.fetch(sorted(k for k in main.specs if "lora_B" in k))]
    moved = any(float(t.abs().max()) > 0 for t in lora_b) if lora_b else True
    norms = [r["grad_norm"] for r in rows if math.isfinite(r.get("grad_norm", math.nan))]
    grads = bool(norms) and max(norms) > 0
    checks["grads_flowing"] = {"ok": grads and moved, "max_grad_norm": max(norms) if norms else None,
                               "detail": ("gradients reach the trained weights" if grads and moved else
                                          "trained weights did not move (zero gradient, lr=0, or targets that match nothing)")}
    skipped = [r["step"] for r in rows if r.get("skipped")]
    checks["no_skipped"] = {"ok": not skipped, "detail": f"skipped updates {skipped[:10]}" if skipped else "none skipped"}
    consistency = [r for r in records if r.get("event") == "ranks_consistent"]
    checks["ranks_consistent"] = {
        "ok": bool(consistency),
        "detail": (f"{consistency[-1]['world_size']} rank(s) agree ({consistency[-1]['method']})" if consistency
                   else "the pilot recorded no cross-rank consistency check"),
    }
    tps = [r["tokens_per_s"] for r in rows[1:]] or [r["tokens_per_s"] for r in rows]
    step_s = statistics.median([r["step_time_s"] for r in rows]) if rows else math.nan
    pilot_end = rows[-1]["step"] if rows else 0
    remaining = plan["total_updates"] - pilot_end
    eta = remaining * step_s
    checks["throughput"] = {"ok": bool(tps) and statistics.median(tps) > 0,
                            "tokens_per_s_median": statistics.median(tps) if tps else 0.0,
                            "detail": f"median {statistics.median(tps) if tps else 0:.0f} tokens/s"}
    return {
        "checks": checks,
        "passed": all(c["ok"] for c in checks.values()),
        "judged_on": "training loss",
        SKIPPED_KEY: [] if _has_validation(checkpoint.config_path) else [NO_VAL],
        "median_step_s": step_s,
        "remaining_updates": remaining,
        "eta_seconds": eta,
    }


def _has_validation(config_path: Path) -> bool:
    """Whether the pilot trained with a validation cache (its resolved config's tokens.val_cache)."""
    import yaml

    tokens = (yaml.safe_load(Path(config_path).read_text()) or {}).get("tokens") or {}
    return bool(tokens.get("val_cache"))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline pilot-gate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pilot", type=Path, required=True, help="the pilot stage's output dir")
    ap.add_argument("--plan", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--override", action="store_true", help="continue even if a check fails")
    args = ap.parse_args(argv)

    plan = json.loads(args.plan.read_text())
    report = run_checks(args.pilot, plan)
    report["override"] = args.override
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, check in report["checks"].items():
        print(f"pilot gate: {name:<16} {'ok  ' if check['ok'] else 'FAIL'} {check['detail']}")
    for phrase in report[SKIPPED_KEY]:
        print(f"pilot gate: {phrase}; {GATE_BASIS}")
    h, rem = divmod(int(report["eta_seconds"]), 3600)
    print(f"pilot gate: ETA of the remaining {report['remaining_updates']} updates at "
          f"{report['median_step_s']:.3f} s/update: {h}h{rem // 60:02d}m (training only)")
    failed = [n for n, c in report["checks"].items() if not c["ok"]]
    if failed and not args.override:
        details = "; ".join(f"{n}: {report['checks'][n]['detail']}" for n in failed)
        err = UserError(f"pilot gate failed ({', '.join(failed)}): {details}. The chunks will not start. "
                        f"Fix the config, or set gate.override: true in config/config.yaml to continue anyway.")
        err.exit_code = EXIT
        raise err
    if failed:
        print(f"pilot gate: checks {failed} failed but gate.override is set; continuing")
    return 0
