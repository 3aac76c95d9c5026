"""A run of several training datasets, one per record shape, spread over the file kinds, mixed.

One whole-DAG run (module fixture `mixed`): the embedded model (its base reused from the session's
default run), its demo conversations converted into Alpaca (JSON array), prompt/completion strings
(JSON Lines), prompt/completion message lists (Parquet, pyarrow), OpenAI messages (a `datasets`
save_to_disk dir), ShareGPT conversations (JSON Lines), plain text (JSON Lines) and tool calls
(JSON Lines, rendered by the built-in `qwen2.5` template: Qwen2.5-Instruct's shipped one), OpenAI
messages as a JSON-string column of a pandas CSV, question/answer columns of a pandas CSV mapped
with the dataset's own `columns`, and ShareGPT and Alpaca in gzip- and zstandard-compressed JSON
Lines, with weights, a record count and datasets taken whole; `data.val: null` and `data.test: null`
both, on to the merged model. Each dataset is validated and tokenized by jobs of its own, and
trained on in the plan's mix counts; adding one more to the finished run validates and tokenizes
only that one (a dry run). In the same workflow copy, a file split into shards has one shard job
killed mid-run: the rerun runs that shard alone.

Another shape or kind is one more entry in DATASETS.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import yaml
from kits.run import copy_run, jobs_with_wildcards, snakemake

pytestmark = pytest.mark.workflow

RUN = "mixed"
GLOBAL_BATCH = 16
TOTAL = 20  # pilot 4 + chunk01 8 + chunk02 8: 320 samples drawn


# --- the demo's conversations ({"id", "conversations": [human, gpt]}) in each shape ------------------

def _turns(record: dict) -> tuple[str, str]:
    human, gpt = record["conversations"]
    return human["value"], gpt["value"]


def alpaca(record: dict) -> dict:
    prompt, answer = _turns(record)
    instruction, _, word = prompt.partition(": ")
    return {"instruction": instruction + ":", "input": word, "output": answer}


def prompt_completion(record: dict) -> dict:
    prompt, answer = _turns(record)
    return {"prompt": prompt, "completion": answer}


def prompt_completion_messages(record: dict) -> dict:
    prompt, answer = _turns(record)
    return {"prompt": [{"role": "user", "content": prompt}], "completion": [{"role": "assistant", "content": answer}]}


def messages(record: dict) -> dict:
    prompt, answer = _turns(record)
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


def conversations(record: dict) -> dict:
    return record


def text(record: dict) -> dict:
    prompt, answer = _turns(record)
    return {"text": f"{prompt} {answer}"}


def question_answer(record: dict) -> dict:
    prompt, answer = _turns(record)
    return {"question": prompt, "response": answer}


def tool_calls(record: dict) -> dict:
    """The answer looked up by a tool: the assistant calls it, the tool's result, then the answer."""
    prompt, answer = _turns(record)
    call = f"call{record['id']}"
    return {"messages": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call, "type": "function", "function": {"name": "lookup", "arguments": {"query": prompt}}}]},
        {"role": "tool", "tool_call_id": call, "content": answer},
        {"role": "assistant", "content": answer},
    ]}


# --- file kinds, each written by the tool that owns it -----------------------------------------------

def write_json(path: Path, records: list[dict]) -> Path:
    path = path.with_suffix(".json")
    path.write_text(json.dumps(records))
    return path


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path = path.with_suffix(".jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(path: Path, records: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = path.with_suffix(".parquet")
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=16)
    return path


def write_csv(path: Path, records: list[dict]) -> Path:
    """pandas' CSV (its index column included, as `to_csv` writes by default); a list cell as its JSON text."""
    import pandas as pd

    path = path.with_suffix(".csv")
    pd.DataFrame([{k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()} for r in records]).to_csv(path)
    return path


def write_jsonl_gz(path: Path, records: list[dict]) -> Path:
    import gzip

    plain = write_jsonl(path, records)
    packed = plain.with_name(plain.name + ".gz")
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    plain.unlink()
    return packed


def write_jsonl_zst(path: Path, records: list[dict]) -> Path:
    import zstandard

    plain = write_jsonl(path, records)
    packed = plain.with_name(plain.name + ".zst")
    packed.write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    plain.unlink()
    return packed


def write_saved_dataset(path: Path, records: list[dict]) -> Path:
    import datasets

    datasets.Dataset.from_list(records).save_to_disk(str(path))
    return path


@dataclass
class Dataset:
    """One training dataset of the mix: its name, shape, file kind, size and share (the config entry's)."""

    name: str
    shape: Callable[[dict], dict]
    write: Callable[[Path, list[dict]], Path]
    size: int
    share: dict = field(default_factory=dict)  # {weight: w} | {records: n} | {} (taken whole)
    kind: str = ""  # the file kind validation names
    own: dict = field(default_factory=dict)  # the config entry's own settings (columns / roles)


DATASETS = [
    Dataset("alpaca", alpaca, write_json, 40, {"weight": 0.4}, "json"),
    Dataset("pc_strings", prompt_completion, write_jsonl, 24, {"weight": 0.2}, "jsonl"),
    Dataset("pc_messages", prompt_completion_messages, write_parquet, 30, {"records": 45}, "parquet"),
    Dataset("messages", messages, write_saved_dataset, 36, {"weight": 0.4}, "arrow"),
    Dataset("conversations", conversations, write_jsonl, 20, {}, "jsonl"),
    Dataset("text", text, write_jsonl, 16, {"records": 8}, "jsonl"),
    Dataset("tools", tool_calls, write_jsonl, 12, {}, "jsonl"),
    Dataset("csv_messages", messages, write_csv, 12, {}, "csv"),
    Dataset("csv_columns", question_answer, write_csv, 12, {"weight": 0.1}, "csv",
            {"columns": {"prompt": "question", "completion": "response"}}),
    Dataset("gz", conversations, write_jsonl_gz, 12, {}, "jsonl.gz"),
    Dataset("zst", alpaca, write_jsonl_zst, 12, {"records": 6}, "jsonl.zst"),
]
NEW = Dataset("added", messages, write_jsonl, 12, {"weight": 0.1})  # the dry run's additional dataset


def _write_datasets(workdir: Path, entries: list[Dataset], records: list[dict]) -> list[dict]:
    """Each dataset's records (disjoint slices of `records`) in its shape and kind; the config's entries."""
    (workdir / "datasets").mkdir(exist_ok=True)
    out, start = [], 0
    for d in entries:
        chunk = [d.shape(r) for r in records[start:start + d.size]]
        start += d.size
        path = d.write(workdir / "datasets" / d.name, chunk)
        out.append({"path": str(path.relative_to(workdir)), "name": d.name, **d.share, **d.own})
    return out


def _demo_records(workdir: Path, n: int) -> list[dict]:
    from pipeline.demo import text as demo

    paths = demo.build_dataset(workdir / "demo-source", n_train=n, n_val=1, n_test=1, seed=7)
    return [json.loads(line) for line in paths["train"].read_text().splitlines()]


def _config(train: list[dict]) -> dict:
    return {
        "run": RUN,
        "model": "embedded",
        "data": {"train": train, "val": None, "test": None, "max_length": 256, "chat_template": "qwen2.5"},
        "schedule": {"total_updates": TOTAL, "pilot_fraction": 0.2, "num_chunks": 2},
        "train": {"overrides": ["optim.lr=2e-3", f"optim.global_batch={GLOBAL_BATCH}", "optim.micro_batch=16",
                                "ema.rates=[0.9,0.98]", "checkpoint.save_every=0"]},
        "gate": {"override": True},  # four pilot updates prove nothing about learning; the data path is the point
        "evaluate": {"gpus": 0, "benchmarks": {"tasks": []}},  # no lm-eval jobs: they read no training data
    }


@pytest.fixture(scope="module")
def mixed(done, tmp_path_factory) -> dict:
    """The finished mixed run, in a copy of the session's default run (its embedded base is reused)."""
    workdir = copy_run(done, tmp_path_factory.mktemp("mixed") / "wf")
    records = _demo_records(workdir, sum(d.size for d in DATASETS) + NEW.size)
    train = _write_datasets(workdir, DATASETS, records)
    (workdir / "mixed.yaml").write_text(yaml.safe_dump(_config(train)))
    proc = snakemake(workdir, "--cores", "all", "--configfile", "mixed.yaml", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {"workdir": workdir, "records": records, "train": train, "log": proc.stdout + proc.stderr}


def _data(mixed: dict) -> Path:
    return mixed["workdir"] / "results" / RUN / "data"


def test_each_dataset_is_validated_and_tokenized_by_its_own_jobs(mixed):
    jobs = jobs_with_wildcards(mixed["log"])
    names = [d.name for d in DATASETS]
    for rule in ("validate_dataset", "tokenize_dataset"):
        assert sorted(w["dataset"] for r, w in jobs if r == rule) == sorted(names)
    assert not {"validate_shard", "tokenize_shard", "tokenize_val", "prepare_base"} & {r for r, _ in jobs}
    ran = {r for r, _ in jobs}
    assert {"data_reports", "plan", "train_stage", "consolidate", "merge_lora", "verify_merge", "smoke_test"} <= ran
    data = _data(mixed)
    kinds = {d.name: d.kind for d in DATASETS}
    validation = json.loads((data / "validation.json").read_text())
    stats = json.loads((data / "stats.json").read_text())
    assert validation["ok"] and set(validation["files"]) == {f"train:{n}" for n in names}  # no val, no test
    for d in DATASETS:
        own = json.loads((data / "train" / d.name / "validation.json").read_text())
        assert own["ok"] and own["files"]["train"]["records_usable"] == d.size
        assert own["files"]["train"]["kind"] == kinds[d.name]
        assert validation["files"][f"train:{d.name}"] == own["files"]["train"]
        assert stats["splits"][f"train:{d.name}"]["records"] == d.size
        assert (data / "train" / d.name / "train.safetensors").is_file()
    assert not (data / "val.safetensors").exists()
    assert (mixed["workdir"] / "results" / RUN / "report" / "labels.html").is_file()


def _expected_per_epoch() -> dict[str, int]:
    """The documented rule, by hand: records exact, whole datasets whole, the weighted ones share their
    records by weight with largest-remainder rounding."""
    weighted = [d for d in DATASETS if "weight" in d.share]
    pool = sum(d.size for d in weighted)
    total_weight = sum(d.share["weight"] for d in weighted)
    exact = {d.name: d.share["weight"] / total_weight * pool for d in weighted}
    counts = {name: int(np.floor(x)) for name, x in exact.items()}
    spare = pool - sum(counts.values())
    for name in sorted(exact, key=lambda n: -(exact[n] - counts[n]))[:spare]:
        counts[name] += 1
    return {d.name: d.share.get("records", counts.get(d.name, d.size)) for d in DATASETS}


def test_the_run_trains_on_the_plan_mix_counts(mixed):
    root = mixed["workdir"] / "results" / RUN
    plan = json.loads((root / "plan.json").read_text())
    mix = {m["name"]: m for m in plan["mix"]}
    assert list(mix) == [d.name for d in DATASETS]
    assert {n: m["records"] for n, m in mix.items()} == {d.name: d.size for d in DATASETS}
    assert {n: m["per_epoch"] for n, m in mix.items()} == _expected_per_epoch()
    assert sum(m["drawn"] for m in mix.values()) == TOTAL * GLOBAL_BATCH
    # what the trainer says each stage drew (metrics.jsonl `mix_drawn`), summed over the stages
    drawn: dict[str, int] = {}
    for stage in plan["stages"]:
        for line in (root / "stages" / stage["name"] / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            if row.get("event") == "mix_drawn":
                for name, n in row["drawn"].items():
                    drawn[name] = drawn.get(name, 0) + n
    assert drawn == {n: m["drawn"] for n, m in mix.items()}
    assert all(n > 0 for n in drawn.values())
    assert "Training datasets mixed" in (root / "report" / "plan.html").read_text()
    assert json.loads((root / "export" / "verification.json").read_text())["passed"]  # val and test null: merged


def test_adding_a_dataset_validates_and_tokenizes_only_it(mixed):
    workdir = mixed["workdir"]
    records = mixed["records"][sum(d.size for d in DATASETS):]
    train = mixed["train"] + _write_datasets(workdir, [NEW], records)
    # The mix changes (tokens.mix), so the run retrains: archive says so and would move the old stages
    # aside when jobs start (never on a dry run); stop would refuse to load.
    (workdir / "added.yaml").write_text(yaml.safe_dump({**_config(train), "on_config_change": "archive"}))
    proc = snakemake(workdir, "-n", "--cores", "1", "--configfile", "added.yaml", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = jobs_with_wildcards(proc.stdout + proc.stderr)
    per_dataset = sorted((r, w["dataset"]) for r, w in jobs if "dataset" in w)
    assert per_dataset == [("tokenize_dataset", NEW.name), ("validate_dataset", NEW.name)]
    ran = {r for r, _ in jobs}
    assert {"data_reports", "plan", "train_stage"} <= ran  # the new mix: re-planned and retrained
    assert not {"prepare_base", "prepare_tokenizer"} & ran


def test_the_reports_say_what_was_skipped_without_val_and_test(mixed):
    """Both `data.val: null` and `data.test: null`: the gate report, the smoke test and the overview
    page name both skips (a phrase each), and no score stands in for either."""
    from pipeline.evaluate.skipped import NO_TEST, NO_VAL
    from pipeline.layout import RunTree

    tree = RunTree(mixed["workdir"] / RunTree.of(RUN).root)
    assert json.loads(tree.pilot_report.read_text())["skipped"] == [NO_VAL]
    smoke = json.loads(tree.smoke_test.read_text())
    assert smoke["exact_match"] is None and smoke["skipped"] == [NO_TEST], smoke
    overview = tree.overview_html.read_text()
    assert f"Skipped: {NO_VAL}." in overview and f"Skipped: {NO_TEST}." in overview


# --- a large file in shards: a shard killed mid-job reruns alone -----------------------------------


def _kill_when_running(proc, workdir: Path, needle: list[str], timeout: float = 600) -> int:
    """SIGKILL the first process under `workdir` whose command line holds every string of `needle`, while
    snakemake (`proc`) runs; its pid."""
    import os
    import signal
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                cwd = os.readlink(f"/proc/{pid}/cwd")
            except OSError:
                continue
            text = [a.decode(errors="replace") for a in args]
            if cwd == str(workdir) and "python" in text[0] and all(n in text for n in needle):
                os.kill(int(pid), signal.SIGKILL)
                return int(pid)
        time.sleep(0.02)
    raise AssertionError(f"no process {needle} ran under {workdir}")


def test_a_shard_killed_mid_job_reruns_alone(mixed):
    """A training file split into 2 shards (data.shard_mb); shard 1's validation job is SIGKILLed while it runs
    (the other goes on: --keep-going); the rerun runs shard 1's validation alone, then what merges it."""
    import subprocess
    import sys

    workdir = mixed["workdir"]
    records = [conversations(r) for r in mixed["records"]]
    big = workdir / "datasets" / "big.jsonl"  # 2 x 2,048-record blocks (pipeline/data/shards.py BLOCK) and more
    big.write_text("".join(json.dumps({**r, "id": f"{i}"}) + "\n" for i in range(4200)
                           for r in [records[i % len(records)]]))
    config = {**_config([{"path": str(big.relative_to(workdir))}]), "run": "sharded",
              "data": {**_config([])["data"], "train": str(big.relative_to(workdir)), "duplicates": "warn",
                       "shard_mb": big.stat().st_size / 2**20 / 2 * 1.001}}
    (workdir / "sharded.yaml").write_text(yaml.safe_dump(config))
    target = "results/sharded/data/stats.json"
    args = [sys.executable, "-m", "snakemake", target, "--cores", "1", "--keep-going", "--configfile", "sharded.yaml"]
    first = subprocess.Popen(args, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**__import__("os").environ, "SFT_PROGRESS": "0"})
    _kill_when_running(first, workdir, ["validate-shard", "1/2"])
    log = first.communicate(timeout=900)[0]
    assert first.returncode != 0, log[-3000:]
    scans = workdir / "results/sharded/data/train/train/shards"
    done = (scans / "validate-0.json").stat().st_mtime_ns  # the other finished
    assert not (scans / "validate-1.json").exists()
    proc = snakemake(workdir, target, "--cores", "1", "--configfile", "sharded.yaml")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    jobs = jobs_with_wildcards(proc.stdout + proc.stderr)
    assert [w["shard"] for r, w in jobs if r == "validate_shard"] == ["1"]
    assert sorted(w["shard"] for r, w in jobs if r == "tokenize_shard") == ["0", "1"]  # after the merge
    assert (scans / "validate-0.json").stat().st_mtime_ns == done
    stats = json.loads((workdir / target).read_text())["splits"]["train"]
    validation = json.loads((workdir / "results/sharded/data/validation.json").read_text())
    assert stats["records"] == 4200 and validation["files"]["train"]["duplicates"] == 4200 - len(records)
    shards = json.loads((workdir / "results/sharded/data/shards.json").read_text())["train"]
    assert shards["shards"] == 2 and [s["records"] for s in shards["tokenize"]] == [2048 + 104, 2048]
