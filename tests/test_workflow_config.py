"""The workflow config's checks at load: every problem at once, each naming its key."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from pipeline import layout, tracker
from pipeline.data import chat, records, tokenize, tokenize_cli, validate
from pipeline.export import merge
from pipeline.planning import checks, guard
from pipeline.data.shapes import CANONICAL_ROLES, OUR_COLUMNS
from pipeline.storage import dtypes
from pipeline.workflow_config import default_differences, path_problems, schema_problems

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / "workflow/schemas/config.schema.yaml"


def _config() -> dict:
    return yaml.safe_load((REPO / "config/config.yaml").read_text())


def test_the_shipped_config_has_no_problem():
    assert schema_problems(_config(), SCHEMA) == [] and path_problems(_config()) == []


# Keys the shipped config sets apart from the schema's defaults, on purpose: the tiny demo model's
# trainer overrides, the EMA rate it exports (one of those overrides' ema.rates), and the demo's own
# benchmark task (a config without evaluate.benchmarks scores nothing: no new jobs for its runs).
DELIBERATE = {"train.overrides", "export.ema_rate", "evaluate.benchmarks.tasks"}


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
    (tmp_path / "empty_dir" / ".gitattributes").write_text("x\n")  # hidden: no data
    (tmp_path / "train.jsonl").write_text("{}\n")
    config = {"model": str(tmp_path / "empty_dir"),
              "data": {"train": str(tmp_path / "train.jsonl"), "val": str(tmp_path / "nope.jsonl"),
                       "test": str(tmp_path / "empty_dir")}}
    assert path_problems(config) == [
        f"model: {tmp_path / 'empty_dir'} is a directory but not a Hugging Face model (no config.json)",
        f"data.val: {tmp_path / 'nope.jsonl'} does not exist",
        f"data.test: {tmp_path / 'empty_dir'} is an empty directory: give a dataset file, a directory of data files "
        "or a `datasets` save_to_disk dir (state.json / dataset_info.json / dataset_dict.json)",
    ]
    # a directory of data files (which of them are data, validation says)
    assert path_problems({"model": "embedded", "data": {"train": str(tmp_path)}}) == []
    # several training datasets: each entry's path, by its index
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "state.json").write_text("{}")
    listed = {"model": "embedded", "data": {"train": [{"path": str(tmp_path / "train.jsonl")},
                                                      {"path": str(tmp_path / "saved")},
                                                      {"path": str(tmp_path / "gone.parquet")}]}}
    assert path_problems(listed) == [f"data.train[2].path: {tmp_path / 'gone.parquet'} does not exist"]
    # where relative image paths start: a directory, the run's or a training dataset's own
    listed["data"].update(image_dir=str(tmp_path / "coco"), train=listed["data"]["train"][:2])
    listed["data"]["train"][1]["image_dir"] = str(tmp_path / "train.jsonl")
    assert path_problems(listed) == [
        f"data.image_dir: {tmp_path / 'coco'} is not a directory (the one the data's relative image paths start from)",
        f"data.train[1].image_dir: {tmp_path / 'train.jsonl'} is not a directory (the one the data's relative image "
        "paths start from)"]
    assert path_problems({"model": "meta-llama/Llama-3.2-1B", "data": {"train": "embedded"}}) == []  # a hub id
    # a glob: the files it matches (which of them are data, validation says)
    globbed = {"model": "embedded", "data": {"train": str(tmp_path / "tr*.jsonl"), "val": str(tmp_path / "v*.jsonl")}}
    assert path_problems(globbed) == [f"data.val: {tmp_path / 'v*.jsonl'} is a glob that matches no file"]
    assert path_problems({"model": "./models/missing", "data": {}}) == [
        "model: ./models/missing does not exist (and is not a hub id like org/name or org/name@revision)"]
    assert path_problems({"model": "https://huggingface.co/Qwen/Qwen3-0.6B/tree/v1.0", "data": {}}) == [
        "model: https://huggingface.co/Qwen/Qwen3-0.6B/tree/v1.0 is a web page; give the model's hub id: "
        "Qwen/Qwen3-0.6B@v1.0"]


def _from_command_line(given: dict) -> dict:
    """config/config.yaml with `given` applied as snakemake applies `--config` (nested values are
    BaseLoader strings; dicts merged, lists replaced), then typed."""
    from snakemake.cli import parse_config
    from snakemake.utils import update_config

    from pipeline.workflow_config import type_command_line

    command_line = parse_config([f"{key}={value}" for key, value in given.items()])
    config = _config()
    update_config(config, command_line)
    type_command_line(config, command_line, SCHEMA)
    return config, command_line


def test_nested_command_line_values_get_the_types_a_config_file_gives():
    config, command_line = _from_command_line({
        "schedule": "{total_updates: 40, pilot_fraction: 0.1}", "data": "{val: null, train: 123}",
        "train": "{nproc: 2, overrides: [optim.lr=1e-3]}", "export": "{ema_rate: 1e-3}",
        "sweep": "{grid: {optim.lr: [1.0e-3, 2.0e-3]}}"})
    assert command_line["schedule"] == {"total_updates": "40", "pilot_fraction": "0.1"}  # what snakemake hands over
    assert config["schedule"] == {"total_updates": 40, "pilot_fraction": 0.1, "num_chunks": 2}
    assert config["data"]["val"] is None and config["data"]["train"] == "123"  # a file name stays a string
    assert config["train"]["nproc"] == 2 and config["train"]["overrides"] == ["optim.lr=1e-3"]
    assert config["export"]["ema_rate"] == 0.001
    assert config["sweep"]["grid"] == {"optim.lr": [0.001, 0.002]}  # as config/sweep.yaml gives them
    assert schema_problems(config, SCHEMA, command_line) == []


def test_a_bad_command_line_value_stays_an_error_that_names_config():
    from pipeline.workflow_config import sources

    config, command_line = _from_command_line({"schedule": "{total_updates: many}", "data": "{max_lenght: 3}"})
    assert schema_problems(config, SCHEMA, command_line) == [
        "data.max_lenght: unknown key (known here: chat_template, chat_template_kwargs, columns, duplicates, image_dir, "
        "max_length, reasoning, roles, shard_mb, test, too_long, train, val) (from --config)",
        "schedule.total_updates: 'many' is not of type 'integer' (from --config)"]
    assert sources([], command_line) == "config/config.yaml, --config data schedule"
    config = _config()
    config["schedule"]["total_updates"] = "many"  # from a file: no --config blamed
    assert schema_problems(config, SCHEMA, command_line={}) == ["schedule.total_updates: 'many' is not of type 'integer'"]


def test_several_training_datasets_get_names_and_their_own_fields(tmp_path):
    from pipeline.workflow_config import train_set_problems, train_sets

    (tmp_path / "saved.v2").mkdir()
    data = {"columns": {"prompt": "question"}, "roles": {},
            "train": [{"path": "data/chat.jsonl", "weight": 0.7},
                      {"path": str(tmp_path / "saved.v2"), "columns": {"completion": "answer"}},
                      {"path": "data/my set.parquet", "name": "domain", "records": 10}]}
    sets = train_sets(data)
    assert list(sets) == ["chat", "saved.v2", "domain"]  # a file's name without its extension; a dir's whole
    assert sets["chat"] == {"path": "data/chat.jsonl", "weight": 0.7, "records": None,
                            "columns": {"prompt": "question"}, "roles": {}, "image_dir": None}
    assert sets["saved.v2"]["columns"] == {"prompt": "question", "completion": "answer"}
    data["image_dir"], data["train"][2]["image_dir"] = "images", "domain/images"  # the run's, one's own on top
    assert [s["image_dir"] for s in train_sets(data).values()] == ["images", "images", "domain/images"]
    assert train_sets({"train": "data/train.jsonl"}) is None  # one file: the single-dataset rules
    # a glob's name: its file name up to the first glob character, else its folder's
    globbed = train_sets({"train": [{"path": "data/train-*.parquet"}, {"path": "web/shards/**/*.jsonl.gz"},
                                    {"path": "code.v2-??.csv"}]})
    assert list(globbed) == ["train", "shards", "code.v2"]
    assert train_set_problems(data) == []
    clash = {"train": [{"path": "a/chat.jsonl"}, {"path": "b/chat.parquet", "weight": 1, "records": 3}]}
    assert train_set_problems(clash) == [
        "data.train[1]: dataset name 'chat' is also data.train[0]'s (names default to the file name): "
        "give each a distinct `name:`",
        "data.train[1] (chat): give a weight or records, not both"]


# --- allowed values: the schema's lists are the code's ------------------------------------------

# Schema key (":keys" a mapping's names, ":values" its values, "[]" a list's items) -> the Python
# list of the values the code accepts there. A list the schema gains must be tied here.
TIED = {
    "on_config_change": guard.MODES,
    "data.too_long": tokenize.TOO_LONG_POLICIES,
    "data.duplicates": records.DUPLICATE_POLICIES,
    "data.reasoning": chat.REASONING_POLICIES,
    "data.columns:keys": OUR_COLUMNS,
    "data.roles:values": CANONICAL_ROLES,
    "data.train[].columns:keys": OUR_COLUMNS,
    "data.train[].roles:values": CANONICAL_ROLES,
    "export.weights": checks.EXPORT_WEIGHTS,
    # the weights a benchmark scores: the base model's name there, and the export dirs
    "evaluate.benchmarks.weights[]": (layout.BENCH_BASE, layout.MERGED, layout.ADAPTER_FINAL, layout.ADAPTER_EMA,
                                      layout.ADAPTER_BEST, layout.ADAPTER_BEST_EMA),
    "export.dtype": dtypes.CLI_CHOICES,
    "tracker.kind": tracker.KINDS,
}


def _enums(node: dict, path: str = ""):
    """(key, allowed values) of every `enum` in a JSON schema, named as TIED names them."""
    if "enum" in node:
        yield path, node["enum"]
    for key, sub in (node.get("properties") or {}).items():
        yield from _enums(sub, f"{path}.{key}" if path else key)
    for part, suffix in (("items", "[]"), ("propertyNames", ":keys"), ("additionalProperties", ":values")):
        if isinstance(node.get(part), dict):
            yield from _enums(node[part], path + suffix)


def test_every_allowed_value_list_of_the_schema_is_the_codes():
    found = dict(_enums(yaml.safe_load(SCHEMA.read_text())))
    assert set(found) == set(TIED), "a list of allowed values in the schema that no test ties to the code"
    differ = {key: (values, list(TIED[key])) for key, values in found.items() if sorted(values) != sorted(TIED[key])}
    assert not differ, f"schema values != the code's (schema, code): {differ}"


def _choices(parser: argparse.ArgumentParser, option: str) -> tuple:
    return tuple(next(a for a in parser._actions if option in a.option_strings).choices)


@pytest.mark.parametrize("command", [validate._parser, tokenize_cli._parser])
def test_the_data_commands_take_the_values_the_schema_allows(command):
    schema = yaml.safe_load(SCHEMA.read_text())["properties"]["data"]["properties"]
    for key in ("too_long", "duplicates", "reasoning"):
        assert sorted(_choices(command(), f"--{key.replace('_', '-')}")) == sorted(schema[key]["enum"]), key


def test_the_export_commands_take_the_values_the_schema_allows():
    schema = yaml.safe_load(SCHEMA.read_text())["properties"]["export"]["properties"]
    assert sorted(_choices(merge._parser(), "--dtype")) == sorted(schema["dtype"]["enum"])
