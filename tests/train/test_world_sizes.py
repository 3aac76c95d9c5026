"""One config from 1 to N ranks: micro-batches derived from the world size, data-parallel evaluation
that computes the same numbers on every world size, and a clear error where ranks cannot share a batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from kits.train import make_run, resolved_config

from pipeline.planning import plan
from pipeline.errors import UserError

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]


def _default_overrides() -> list[str]:
    """The trainer settings of the default run (config/config.yaml train.overrides)."""
    return yaml.safe_load((REPO / "config/config.yaml").read_text())["train"]["overrides"]


def _records(run, stage: str) -> list[dict]:
    return [json.loads(x) for x in (run.stage_dir(stage) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_the_default_config_runs_on_1_2_and_4_ranks(tiny, tmp_path, ranks):
    run = make_run(tmp_path, tiny, total=2, fraction=0.5, chunks=1, single_stage=True,
                   overrides=[*_default_overrides(), "validation.every=0", "checkpoint.save_every=0"])
    proc = run.train("all", nproc=ranks if ranks > 1 else None)
    micro = {1: 16, 2: 16, 4: 8}[ranks]  # global batch 32, micro-batch at most 16
    assert f"micro-batch {micro} x {32 // ranks // micro}" in proc.stdout
    updates = [r for r in _records(run, "all") if "loss" in r]
    assert [r["step"] for r in updates] == [1, 2]


def test_a_batch_the_ranks_cannot_share_fails_at_plan_naming_the_keys(tiny, tmp_path):
    args = ["--total-updates", "4", "--pilot-fraction", "0.5", "--num-chunks", "1",
            *resolved_config([f"model.path={tiny['model']}", f"tokens.train_cache={tiny['train']}", *_default_overrides()]),
            "--world-size", "3", "--export-weights", "raw",
            "--out-plan", str(tmp_path / "plan.json"), "--out-config", str(tmp_path / "c.yaml")]
    with pytest.raises(UserError) as err:
        plan.main(args)
    assert "optim.global_batch=32 cannot be shared by 3 ranks" in str(err.value)
    assert "optim.micro_batch=16" in str(err.value)


def test_evaluation_gives_the_same_numbers_on_one_and_two_ranks(tiny, tmp_path):
    """With lr=0 both runs hold the same weights; the data-parallel evaluation (batch b on rank
    b % world, sums added in batch order) must then report the very same losses."""
    evals = {}
    for ranks in (1, 2):
        run = make_run(tmp_path / f"r{ranks}", tiny, total=2, fraction=0.5, chunks=1, single_stage=True,
                       overrides=["optim.lr=0.0", "validation.every=1", "validation.batch_size=3"])
        run.train("all", nproc=ranks if ranks > 1 else None)
        evals[ranks] = [{k: v for k, v in r.items() if k.startswith("val_")}
                        for r in _records(run, "all") if r.get("event") == "eval"]
    assert len(evals[1]) == 2 and evals[1] == evals[2]  # 16 records in 6 batches: uneven shares too
