"""The data settings as the workflow sees them: the config schema and the commands the data rules run."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from kits.run import copy_workflow, snakemake  # tests/kits/run.py: the workflow tests' helpers

REPO = Path(__file__).resolve().parents[2]
SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"


def _validated(config: dict) -> dict:
    from snakemake.utils import validate

    config = copy.deepcopy(config)
    validate(config, str(SCHEMA))  # fills in defaults, as the Snakefile's validate() does
    return config


def test_duplicates_setting_defaults_to_error_and_takes_only_the_policies():
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    assert config["data"]["duplicates"] == "error"
    del config["data"]["duplicates"]
    assert _validated(config)["data"]["duplicates"] == "error"
    for policy in ("warn", "drop"):
        assert _validated({**config, "data": {**config["data"], "duplicates": policy}})["data"]["duplicates"] == policy
    from snakemake.exceptions import WorkflowError

    with pytest.raises(WorkflowError):
        _validated({**config, "data": {**config["data"], "duplicates": "keep"}})


def _shell_commands(text: str) -> dict[str, str]:
    """`python -m pipeline <command> ...` lines of a dry run (-p), by command."""
    found = {}
    for line in text.splitlines():
        if "python -m pipeline " in line:
            command = line.split("python -m pipeline ", 1)[1]
            found[command.split()[0]] = command
    return found


def test_data_rules_pass_the_policy_the_template_switches_and_a_failed_report_dir(tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    (workdir / "extra.yaml").write_text("data:\n  duplicates: drop\n  chat_template_kwargs: {enable_thinking: false}\n")
    # Targets before --configfile, which takes several values.
    proc = snakemake(workdir, "results/demo/data/stats.json", "-n", "-p", "--cores", "1",
                     "--configfile", "extra.yaml", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    commands = _shell_commands(proc.stdout + proc.stderr)
    validate, tokenize = (commands[name].split(" --") for name in ("validate", "tokenize"))  # "option value"
    assert "duplicates drop" in validate and "duplicates drop" in tokenize
    # the template's switches reach the run tokenizer, as one shell word of JSON
    assert "--template-kwargs '{\"enable_thinking\": false}'" in commands["prepare-tokenizer"]
    # undeclared, so it outlives a failed job (whose declared outputs Snakemake deletes)
    assert "failed-report-dir results/demo/data/train/train/validation_failed" in validate


def test_null_val_and_test_pass_no_flag_without_its_value(tmp_path):
    """data.val / data.test: null (documented "null to skip") leave their flags out, not '--test ' with no value;
    the field settings reach every command that reads data."""
    workdir = copy_workflow(tmp_path / "wf")
    (workdir / "nulls.yaml").write_text("data:\n  val: null\n  test: null\n  columns: {prompt: question}\n"
                                        "  image_dir: my images\n")
    (workdir / "my images").mkdir()
    proc = snakemake(workdir, "-n", "-p", "--cores", "1", "--configfile", "nulls.yaml", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line.split("python -m pipeline ", 1)[1] for line in (proc.stdout + proc.stderr).splitlines()
             if "python -m pipeline " in line]
    commands = {line.split()[0] for line in lines}
    assert {"validate", "tokenize", "evaluate", "smoke-test"} <= commands
    for line in lines:
        words = line.split()
        for flag in ("--val", "--out-val", "--test"):
            assert flag not in words, line
        if words[0] in ("validate", "tokenize", "evaluate", "smoke-test"):
            # data.columns and data.image_dir reach every reader of the data (a path with a space: one shell word)
            assert "--columns prompt=question" in line and "--image-dir 'my images'" in line


def test_a_large_file_is_sharded_and_every_data_job_gets_the_same_data_flags(tmp_path):
    """data.shard_mb: a file over it is validated and tokenized by shard jobs (one rule family with a `{dataset}`
    and a `{shard}` wildcard); every data command gets the data settings from the one helper."""
    workdir = copy_workflow(tmp_path / "wf")
    train = workdir / "big.jsonl"
    line = json.dumps({"messages": [{"role": "user", "content": "hi " * 40}, {"role": "assistant", "content": "ok"}]})
    train.write_text("".join(line.replace("hi", f"h{i}", 1) + "\n" for i in range(3000)))  # ~0.8 MiB
    (workdir / "big.yaml").write_text(yaml.safe_dump({"data": {
        "train": "big.jsonl", "shard_mb": 0.3, "max_length": 512, "too_long": "truncate", "duplicates": "drop",
        "columns": {"id": "key"}}}))
    proc = snakemake(workdir, "results/demo/data/stats.json", "-n", "-p", "--cores", "1", "--configfile",
                     "big.yaml", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line.split("python -m pipeline ", 1)[1] for line in (proc.stdout + proc.stderr).splitlines()
             if "python -m pipeline " in line]
    by_command: dict[str, list[str]] = {}
    for text in lines:
        by_command.setdefault(text.split()[0], []).append(text)
    assert len(by_command["validate-shard"]) == len(by_command["tokenize-shard"]) == 3  # 0.8 MiB / 0.3
    assert sorted(t.split("--shard ")[1].split()[0] for t in by_command["tokenize-shard"]) == ["0/3", "1/3", "2/3"]
    (merge,) = by_command["validate"]
    assert "--scans results/demo/data/train/train/shards/validate-0.json" in merge
    assert any("--parts" in t for t in by_command["tokenize"])
    for command in ("validate-shard", "validate", "tokenize-shard", "tokenize"):
        for text in by_command[command]:
            assert "--max-length 512 --too-long truncate --reasoning auto" in text, text
            assert ("--duplicates drop" in text) == (command != "validate-shard"), text
            assert "--columns id=key" in text, text


def test_globs_reach_every_reader_of_the_data_as_given_and_shard_by_the_files_they_match(tmp_path):
    """data.train / val / test as globs (`data/train-*.jsonl`): every command that reads a dataset gets the glob
    as one shell word (the shell must not expand it), and a training dataset is sharded by its files' bytes."""
    workdir = copy_workflow(tmp_path / "wf")
    data = workdir / "data"
    data.mkdir()
    line = json.dumps({"messages": [{"role": "user", "content": "hi " * 40}, {"role": "assistant", "content": "ok"}]})
    for k in range(3):  # ~0.27 MiB each
        (data / f"train-{k:05d}.jsonl").write_text("".join(line.replace("hi", f"h{k}-{i}", 1) + "\n"
                                                           for i in range(1000)))
    for split in ("val", "test"):
        (data / f"{split}-00000.jsonl").write_text(line + "\n")
    (workdir / "globs.yaml").write_text(yaml.safe_dump({"data": {
        "train": "data/train-*.jsonl", "val": "data/val-*.jsonl", "test": "data/test-*.jsonl", "shard_mb": 0.3,
        "max_length": 512, "too_long": "truncate"}}))
    proc = snakemake(workdir, "-n", "-p", "--cores", "1", "--configfile", "globs.yaml", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    by_command: dict[str, list[str]] = {}
    for text in (proc.stdout + proc.stderr).splitlines():
        if "python -m pipeline " in text:
            command = text.split("python -m pipeline ", 1)[1]
            by_command.setdefault(command.split()[0], []).append(command)
    assert len(by_command["validate-shard"]) == len(by_command["tokenize-shard"]) == 3  # 0.8 MiB / 0.3
    for command in ("validate-shard", "validate", "tokenize-shard"):
        assert all("--train 'data/train-*.jsonl'" in text for text in by_command[command]), command
    (validate,) = by_command["validate"]
    assert "--val 'data/val-*.jsonl' --test 'data/test-*.jsonl'" in validate
    assert any("--val 'data/val-*.jsonl'" in text for text in by_command["tokenize"])
    assert any("--train 'data/train-*.jsonl'" in text for text in by_command["tokenize"])
    for command in ("evaluate", "smoke-test"):
        assert by_command[command] and all("--test 'data/test-*.jsonl'" in text for text in by_command[command])


def test_a_local_folder_of_several_splits_gives_each_key_its_split(tmp_path):
    """A dataset repo as `hf download --local-dir` leaves it (push_to_hub's shards, its card's configs): data.train
    and data.test name the folder and read its train and test splits, said once as the workflow loads; data.val
    naming it, with no validation split there, stops the workflow with one line naming the splits it has."""
    import datasets

    workdir = copy_workflow(tmp_path / "wf")
    repo = workdir / "no_robots"
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
            for i in range(4)]
    for name, part in (("train-00000-of-00002.parquet", rows[:2]), ("train-00001-of-00002.parquet", rows[2:3]),
                       ("test-00000-of-00001.parquet", rows[3:])):
        datasets.Dataset.from_list(part).to_parquet(str(repo / "data" / name))
    (repo / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
                                    "    path: data/train-*\n  - split: test\n    path: data/test-*\n---\n")
    (workdir / "folder.yaml").write_text(yaml.safe_dump({"data": {"train": "no_robots", "val": None,
                                                                  "test": "no_robots"}}))
    proc = snakemake(workdir, "-n", "-p", "--cores", "1", "--configfile", "folder.yaml", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "data.train: no_robots holds several splits: reading its train split, no_robots/data/train-*" in out
    commands = _shell_commands(out)
    assert "--train 'no_robots/data/train-*' --test no_robots/data/test-00000-of-00001.parquet " in commands["validate"]
    assert "--test no_robots/data/test-00000-of-00001.parquet " in commands["smoke-test"]

    (workdir / "folder.yaml").write_text(yaml.safe_dump({"data": {"train": "no_robots", "val": "no_robots"}}))
    proc = snakemake(workdir, "-n", "--cores", "1", "--configfile", "folder.yaml", timeout=120)
    assert proc.returncode != 0
    assert ("no_robots has no validation split (its splits: test: data/test-00000-of-00001.parquet; train: "
            "data/train-00000-of-00002.parquet, data/train-00001-of-00002.parquet): give that split's files as a "
            "glob, e.g. no_robots/data/train-*.parquet (or data.val: null to go without one)") in proc.stdout + proc.stderr
