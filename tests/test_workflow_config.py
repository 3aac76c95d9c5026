"""The workflow config's checks at load: every problem at once, each naming its key."""

from __future__ import annotations

from pathlib import Path

import yaml

from pipeline.workflow_config import default_differences, path_problems, schema_problems

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / "workflow/schemas/config.schema.yaml"


def _config() -> dict:
    return yaml.safe_load((REPO / "config/config.yaml").read_text())


def test_the_shipped_config_has_no_problem():
    assert schema_problems(_config(), SCHEMA) == [] and path_problems(_config()) == []


# Keys the shipped config sets apart from the schema's defaults, on purpose: the tiny demo model's
# trainer overrides, and the EMA rate it exports (one of those overrides' ema.rates).
DELIBERATE = {"train.overrides", "export.ema_rate"}


def test_the_shipped_config_states_the_schema_defaults():
    # The schema holds each default; config/config.yaml shows every key with that same value, so
    # the two cannot drift apart (evaluate.max_new_tokens was 32 in one, 16 in the other).
    differences = default_differences(_config(), SCHEMA)
    assert set(differences) == DELIBERATE, {k: v for k, v in differences.items() if k not in DELIBERATE}


def test_a_drifted_or_missing_default_is_caught():
    config = _config()
    config["evaluate"]["max_new_tokens"] = 32
    del config["tracker"]["project"]
    config["gate"]["override"] = 0
    differences = default_differences(config, SCHEMA)
    assert differences["evaluate.max_new_tokens"] == "32, the schema's default is 16"
    assert differences["tracker.project"] == "missing (the schema's default: 'sft')"
    assert "gate.override" in differences  # 0 is not false
    assert set(differences) - DELIBERATE == {"evaluate.max_new_tokens", "tracker.project", "gate.override"}


def test_every_schema_problem_is_listed_with_its_key():
    config = _config()
    config["trian"] = {}
    config["data"]["max_lenght"] = 64
    config["schedule"]["total_updates"] = "many"
    config["export"]["weights"] = "best"
    problems = schema_problems(config, SCHEMA)
    assert len(problems) == 4, problems
    assert any(p.startswith("trian: unknown key") for p in problems)
    assert any(p.startswith("data.max_lenght: unknown key (known here: ") and "max_length" in p for p in problems)
    assert "schedule.total_updates: 'many' is not of type 'integer'" in problems
    assert any(p.startswith("export.weights: 'best' is not one of") for p in problems)


def test_paths_name_the_key_that_holds_them(tmp_path):
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "train.jsonl").write_text("{}\n")
    config = {"model": str(tmp_path / "empty_dir"),
              "data": {"train": str(tmp_path / "train.jsonl"), "val": str(tmp_path / "nope.jsonl"), "test": str(tmp_path)}}
    assert path_problems(config) == [
        f"model: {tmp_path / 'empty_dir'} is a directory but not a Hugging Face model (no config.json)",
        f"data.val: {tmp_path / 'nope.jsonl'} does not exist",
        f"data.test: {tmp_path} is not a file (a JSON or JSONL dataset)",
    ]
    assert path_problems({"model": "meta-llama/Llama-3.2-1B", "data": {"train": "embedded"}}) == []  # a hub id
    assert path_problems({"model": "./models/missing", "data": {}}) == [
        "model: ./models/missing does not exist (and is not a hub id like org/name or org/name@revision)"]
