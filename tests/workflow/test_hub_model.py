"""`model:` given by hub id, offline: read from a Hugging Face cache laid out as `hf download`
leaves it, pinned to the commit recorded in the plan; not cached, the workflow stops as it loads.

The cache holds the session's tiny model (conftest `tiny`) as snapshot <sha> of `org/tiny-llama`;
a short schedule (pilot 2 + chunk01 2 updates) runs through training, the merge and its check.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from kits.hub import add_to_cache
from kits.run import copy_workflow, jobs_in_log, snakemake

pytestmark = pytest.mark.workflow

REPO_ID = "org/tiny-llama"


def _config(workdir: Path, tiny: dict, model: str) -> None:
    data = Path(tiny["root"]) / "data"
    variant = {
        "run": "hub", "model": model,
        "data": {"train": str(data / "train.jsonl"), "val": str(data / "val.jsonl"), "test": str(data / "test.jsonl"),
                 "max_length": 64},
        "schedule": {"total_updates": 4, "pilot_fraction": 0.5, "num_chunks": 1},
        "gate": {"override": True},  # two updates prove nothing about learning; the path is the point
        "evaluate": {"gpus": 0, "max_test": 2},
    }
    (workdir / "hub.yaml").write_text(yaml.safe_dump(variant))


def test_a_cached_hub_id_runs_offline_pinned_to_the_commit_in_the_plan(tiny, tmp_path):
    cache = tmp_path / "hf-cache"
    snapshot = add_to_cache(cache, REPO_ID, Path(tiny["model"]))
    workdir = copy_workflow(tmp_path / "wf")
    _config(workdir, tiny, REPO_ID)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    target = "results/hub/export/verification.json"
    proc = snakemake(workdir, target, "--cores", "all", "--configfile", "hub.yaml", env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    ran = [rule for rule, _ in jobs_in_log(proc.stdout + proc.stderr)]
    assert ran.count("fetch_model") == 1 and "prepare_base" not in ran
    assert {"validate_dataset", "tokenize_dataset", "plan", "train_stage", "consolidate", "merge_lora", "verify_merge"} <= set(ran)
    pinned = {"repo_id": REPO_ID, "revision": snapshot.name}
    assert json.loads((workdir / "results/hub/plan.json").read_text())["model"] == pinned
    record = json.loads((workdir / "results/hub/model.json").read_text())
    assert record == {**pinned, "path": str(snapshot)}
    assert json.loads((workdir / target).read_text())["passed"]
    # The cache is only read: nothing was added to the model's snapshot.
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(p.name for p in Path(tiny["model"]).iterdir())


def test_an_uncached_hub_id_offline_stops_before_any_job_with_one_line(tiny, tmp_path):
    cache = tmp_path / "empty-cache"
    cache.mkdir()
    workdir = copy_workflow(tmp_path / "wf")
    _config(workdir, tiny, "org/not-cached@v1")
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    proc = snakemake(workdir, "-n", "--cores", "all", "--configfile", "hub.yaml", env=env, timeout=120)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    line = next(line for line in out.splitlines() if "org/not-cached" in line)
    assert line == (f"model: org/not-cached@v1 is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE=1 "
                    f"forbids downloading it: run `hf download org/not-cached --revision v1 --cache-dir {cache}` "
                    "on a machine with network access (into that cache), or set model: to a local model directory")
    assert jobs_in_log(out) == []
