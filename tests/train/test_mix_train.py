"""A run mixing two token caches: chunked == one run bitwise, and it trains on the plan's mix counts."""

from __future__ import annotations

import json

from kits.train import final_digests, make_run, step_losses

TOTAL = 12  # updates of 8 samples: 96 samples, inside the first mixed epoch of 112


def _mixed(tiny) -> list[str]:
    """The tiny train cache (96 records) and val cache (16) as two training datasets at 0.7 / 0.3."""
    mix = (f"tokens.mix=[{{name:chat,cache:{tiny['train']},weight:0.7}},"
           f"{{name:domain,cache:{tiny['val']},weight:0.3}}]")
    return ["tokens.train_cache=null", mix]


def _drawn(stage_dirs) -> dict[str, int]:
    total: dict[str, int] = {}
    for d in stage_dirs:
        for line in (d / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            if row.get("event") == "mix_drawn":
                for name, n in row["drawn"].items():
                    total[name] = total.get(name, 0) + n
    return total


def test_mixed_chunked_run_equals_one_run_and_draws_the_plan_counts(tiny, tmp_path):
    reference = make_run(tmp_path / "one", tiny, total=TOTAL, fraction=0.25, single_stage=True,
                         overrides=_mixed(tiny))
    reference.train("all")
    # Two stages, each a fresh process (three processes in all: the chunked chain of four is
    # tests/train/test_exact_resume.py's; this checks the mix's part of it, the data order).
    run = make_run(tmp_path / "chunked", tiny, total=TOTAL, fraction=0.25, single_stage=True,
                   overrides=_mixed(tiny))
    plan_json = json.loads(run.plan.read_text())
    plan_json["stages"] = [{"name": "first", "start": 0, "end": 5}, {"name": "second", "start": 5, "end": TOTAL}]
    run.plan.write_text(json.dumps(plan_json))
    names = ["first", "second"]
    run.chain(names)
    assert final_digests(run, "second") == final_digests(reference)  # adapter, EMAs, optimizer: byte for byte
    assert step_losses([run.stage_dir(s) for s in names]) == step_losses([reference.stage_dir("all")])

    plan = json.loads(run.plan.read_text())["mix"]
    # 112 records per mixed epoch shared 0.7 / 0.3: 78.4 -> 78 and 33.6 -> 34 (largest remainder)
    assert [(m["name"], m["records"], m["per_epoch"]) for m in plan] == [("chat", 96, 78), ("domain", 16, 34)]
    assert sum(m["drawn"] for m in plan) == TOTAL * 8
    drawn = {m["name"]: m["drawn"] for m in plan}
    assert _drawn([run.stage_dir(s) for s in names]) == drawn == _drawn([reference.stage_dir("all")])
