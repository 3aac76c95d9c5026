"""`data.train` / `data.val` given as a local glob (`data/train-*.jsonl`): the files it matches are one
dataset, declared to Snakemake one by one (a shard added reruns what read them) and handed to every command
as the glob. snakemake runs only up to the tokenized data.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from kits.run import copy_workflow, jobs_in_log, snakemake

from pipeline.data.cache import TokenCache
from pipeline.data.tokenize import load_tokenizer, tokenize_file, tokenizer_fingerprint

pytestmark = pytest.mark.workflow

TOKENIZED = "results/glob/data/train/train/train.safetensors"
VAL = "results/glob/data/val.safetensors"


def _tokens(path: Path) -> list:
    cache = TokenCache(path)
    return [[t.tolist() for t in cache[i]] for i in range(len(cache))]


def test_a_glob_of_files_is_one_dataset_and_a_file_added_reruns_its_jobs(tiny, tmp_path):
    lines = [line for line in (Path(tiny["root"]) / "data" / "train.jsonl").read_text().splitlines() if line.strip()]
    workdir = copy_workflow(tmp_path / "wf")
    data = workdir / "data"
    data.mkdir()
    for k, start in enumerate(range(0, 60, 20)):  # three shards as a partitioned write leaves them
        (data / f"train-{k:05d}.jsonl").write_text("".join(line + "\n" for line in lines[start:start + 20]))
    (data / "README.md").write_text("# shards of the demo task\n")  # matched by no data glob
    (data / "val-00000.jsonl").write_text((Path(tiny["root"]) / "data" / "val.jsonl").read_text())
    shard_mb = sum(f.stat().st_size for f in data.glob("train-*")) / 2**20 / 1.5  # two shard jobs per step
    (workdir / "glob.yaml").write_text(yaml.safe_dump({
        "run": "glob", "model": str(tiny["model"]),
        "data": {"train": "data/train-*.jsonl", "val": "data/val-*", "test": None, "max_length": 64,
                 "shard_mb": shard_mb}}))
    proc = snakemake(workdir, TOKENIZED, VAL, "--cores", "all", "--configfile", "glob.yaml", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ran = [rule for rule, _ in jobs_in_log(proc.stdout + proc.stderr)]
    assert ran.count("validate_shard") == ran.count("tokenize_shard") == 2, ran
    assert {"validate_dataset", "tokenize_dataset", "tokenize_val"} <= set(ran)

    # The files in order are the records of the one file they were cut from, tokenized with the run's tokenizer.
    tokenizer_dir = workdir / "results/glob/tokenizer"
    expected = tmp_path / "expected.safetensors"
    whole = tmp_path / "whole.jsonl"
    whole.write_text("".join(line + "\n" for line in lines[:60]))
    tokenize_file(whole, load_tokenizer(tokenizer_dir), out_path=expected, max_length=64, too_long="error",
                  fingerprint=tokenizer_fingerprint(tokenizer_dir), split="train")
    assert _tokens(workdir / TOKENIZED) == _tokens(expected)
    assert len(TokenCache(workdir / VAL)) == len((data / "val-00000.jsonl").read_text().splitlines())
    files = json.loads((workdir / "results/glob/data/train/train/validation.json").read_text())["files"]
    assert files["train"]["path"] == "data/train-*.jsonl" and files["train"]["records"] == 60  # named as given
    assert files["val"]["path"] == "data/val-*" and files["val"]["kind"] == "jsonl"

    again = snakemake(workdir, TOKENIZED, VAL, "--cores", "all", "--configfile", "glob.yaml", timeout=120)
    assert again.returncode == 0 and jobs_in_log(again.stdout + again.stderr) == []

    # A shard added to the folder is part of the dataset: its jobs run again and the cache holds its records.
    (data / "train-00003.jsonl").write_text("".join(line + "\n" for line in lines[60:70]))
    more = snakemake(workdir, TOKENIZED, "--cores", "all", "--configfile", "glob.yaml", timeout=300)
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-6000:]
    assert {"validate_dataset", "tokenize_dataset"} <= {rule for rule, _ in jobs_in_log(more.stdout + more.stderr)}
    assert len(TokenCache(workdir / TOKENIZED)) == 70
