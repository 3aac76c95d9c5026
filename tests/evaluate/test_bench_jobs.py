"""The benchmark job (`python -m pipeline benchmark`) and the offline data check (`fetch-benchmarks --check`)
on real lm-eval tasks: offline, cached by content, and scoring an adapter of a run that added tokens as
its merged model scores.

The "hub" dataset here is a real `datasets` cache entry: the Arrow file and dataset_info.json that
`datasets` writes when it prepares a dataset, filed where `datasets` looks for a hub dataset it cannot
reach (<HF_DATASETS_CACHE>/<org>___<name>/<config>/<version>/<hash>/): what `fetch-benchmarks` leaves
behind on a login node, without the network.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kits.token import make_base
from kits.train import make_run, pipeline_env

from pipeline.demo import benchmark as demo_bench
from pipeline.planning.benchmarks import OFFLINE_ENV

WORDS = ["abcd", "bcde", "cdef", "defg", "efgh", "fghi", "ghij", "hijk", "ijkl", "jklm", "klmn", "lmno"]
MC = """task: {name}
dataset_path: {path}
{kwargs}test_split: test
output_type: multiple_choice
doc_to_text: "repeat: {{{{word}}}}"
doc_to_choice: choices
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
{extra}"""


def _hub_cache(root: Path, docs: list[dict]) -> Path:
    """A datasets cache holding the hub dataset acme/tiny (config default, split test)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(docs), root / "docs.parquet")
    scratch = root / "prepare"
    datasets.load_dataset("parquet", data_files={"test": str(root / "docs.parquet")}, cache_dir=str(scratch))
    prepared = next(Path(p) for p in glob.glob(str(scratch / "parquet" / "*" / "*" / "*")) if Path(p).is_dir())
    target = root / "datasets" / "acme___tiny" / "default" / "0.0.0" / prepared.name
    target.mkdir(parents=True)
    for f in prepared.iterdir():
        shutil.copy(f, target / f.name.replace("parquet-", "tiny-"))
    return root / "datasets"


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> dict:
    """Task YAMLs: a hub dataset in the cache, one that is not, a local one, one whose code asks nltk for data."""
    root = tmp_path_factory.mktemp("bench_tasks")
    docs = demo_bench.documents(WORDS)
    (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    local = f"dataset_kwargs:\n  data_files:\n    test: {root / 'docs.jsonl'}\n"
    (root / "hub.yaml").write_text(MC.format(name="hub_choice", path="acme/tiny", kwargs="", extra=""))
    (root / "absent.yaml").write_text(MC.format(name="absent_choice", path="acme/absent", kwargs="", extra=""))
    (root / "local.yaml").write_text(MC.format(name="local_choice", path="json", kwargs=local, extra=""))
    (root / "nltk_task").mkdir()
    (root / "nltk_task" / "utils.py").write_text(
        "import nltk\nnltk.download('pipeline_test_resource')  # as IFEval's module does at import\n\n"
        "def process_docs(ds):\n    return ds\n")
    (root / "nltk_task" / "task.yaml").write_text(
        MC.format(name="nltk_choice", path="json", kwargs=local, extra="process_docs: !function utils.process_docs\n"))
    return {"root": root, "cache": _hub_cache(root, docs), "docs": docs}


def _env(tasks, tmp_path) -> dict:
    """No offline variables set by the test: the job sets them itself. An empty HF home and hub cache."""
    env = pipeline_env({"HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(tasks["cache"]),
                        "NLTK_DATA": str(tmp_path / "nltk")})
    for key in OFFLINE_ENV:
        env.pop(key, None)
    return env


def _benchmark(tiny, task: Path, out: Path, env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipeline", "benchmark", "--weights", str(tiny["model"]), "--tokenizer",
           str(tiny["model"]), "--name", "base", "--task", str(task), "--batch-size", "4",
           "--cache-dir", str(out.parent / "cache"), "--out", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def test_a_cached_hub_task_is_scored_offline_and_a_rerun_on_the_same_weights_is_copied(tiny, tasks, tmp_path):
    env = _env(tasks, tmp_path)
    proc = _benchmark(tiny, tasks["root"] / "hub.yaml", tmp_path / "first.json", env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first = json.loads((tmp_path / "first.json").read_text())
    (acc,) = first["scores"]
    assert (acc["task"], acc["label"], acc["n"], first["cached"]) == ("hub_choice", "acc", len(tasks["docs"]), False)
    assert 0 <= acc["value"] <= 1 and acc["stderr"] > 0 and first["chat_template_applied"] is True
    assert len(first["docs"]["hub_choice"]["acc"]) == acc["n"]  # each document's score, for the paired difference
    again = _benchmark(tiny, tasks["root"] / "hub.yaml", tmp_path / "again.json", env)
    assert again.returncode == 0, again.stderr[-4000:]
    copied = json.loads((tmp_path / "again.json").read_text())
    assert copied["cached"] is True and copied["scores"] == first["scores"] and copied["key"] == first["key"]
    # A dataset that is not cached: the job is offline (datasets says so), and says how to fetch it.
    missing = _benchmark(tiny, tasks["root"] / "absent.yaml", tmp_path / "absent.json", env)
    assert missing.returncode == 2 and not (tmp_path / "absent.json").exists()
    assert "task absent_choice: its data is not in the local Hugging Face datasets cache" in missing.stderr
    assert "OfflineModeIsEnabled" in missing.stderr and "fetch-benchmarks" in missing.stderr


def test_the_offline_check_names_each_task_that_misses_data_once(tasks, tmp_path):
    root = tasks["root"]
    cmd = [sys.executable, "-m", "pipeline", "fetch-benchmarks", "--check", str(root / "hub.yaml"),
           str(root / "absent.yaml"), str(root / "local.yaml"), str(root / "nltk_task" / "task.yaml")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(tasks, tmp_path), timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, proc.stdout
    assert lines[0].startswith("evaluate.benchmarks: task absent_choice: its data is not in the local Hugging Face "
                               "datasets cache") and lines[0].endswith(f"fetch-benchmarks {root / 'absent.yaml'}")
    assert lines[1] == ("evaluate.benchmarks: task nltk_choice needs nltk data pipeline_test_resource, not found "
                        "(NLTK_DATA or ~/nltk_data); fetch it where there is network: python -m pipeline "
                        f"fetch-benchmarks {root / 'nltk_task' / 'task.yaml'}")
    # Fetching (no --check) builds the task as lm-eval does, and says so; a local task needs nothing else.
    proc = subprocess.run([sys.executable, "-m", "pipeline", "fetch-benchmarks", str(root / "local.yaml")],
                          capture_output=True, text=True, env=_env(tasks, tmp_path), timeout=600)
    assert proc.returncode == 0 and proc.stdout == f"{root / 'local.yaml'}: cached (1 task built)\n", proc.stderr[-3000:]


def test_a_group_is_built_as_its_tasks_without_a_deprecated_lm_eval_call(tasks, tmp_path):
    """A group YAML builds its two tasks, counted as such, through the API the installed lm-eval keeps
    (0.4.13 deprecates `get_task_dict`, the only one of the 0.4.10 floor: .ci/floors runs this too)."""
    root = tmp_path / "group"
    root.mkdir()
    local = f"dataset_kwargs:\n  data_files:\n    test: {tasks['root'] / 'docs.jsonl'}\n"
    for name in ("pair_a", "pair_b"):
        (root / f"{name}.yaml").write_text(MC.format(name=name, path="json", kwargs=local, extra=""))
    (root / "pair.yaml").write_text("group: pair_choice\ntask:\n  - pair_a\n  - pair_b\n"
                                    "aggregate_metric_list:\n  - metric: acc\n")
    env = {**_env(tasks, tmp_path), "PYTHONWARNINGS": "error::DeprecationWarning:pipeline.evaluate.bench_data"}
    proc = subprocess.run([sys.executable, "-m", "pipeline", "fetch-benchmarks", str(root / "pair.yaml")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and proc.stdout == f"{root / 'pair.yaml'}: cached (2 tasks built)\n", proc.stderr[-3000:]
    assert "deprecated" not in proc.stderr.lower(), proc.stderr[-3000:]


@pytest.fixture(scope="module")
def chatml_run(tmp_path_factory) -> dict:
    """A base without a chat template, trained with `chatml` (its markers added to the vocabulary, their rows
    trained as peft trainable tokens), exported as an adapter dir and a merged model."""
    from pipeline.export.consolidate import consolidate
    from pipeline.export.merge import merge_dirs

    root = tmp_path_factory.mktemp("bench_chatml")
    base = make_base(root / "base", "chatml")
    run = make_run(root / "run", base, total=6, fraction=0.5, single_stage=True,
                   overrides=[f"model.tokenizer={base['tokenizer']}", "optim.lr=1e-2"])
    run.train("all")
    out = root / "export"
    consolidate(run.stage_dir("all") / "checkpoint", base["model"], out_adapter=out / "adapter_final",
                models="main", tokenizer=base["tokenizer"])
    merge_dirs(base["model"], out / "adapter_final", out / "merged")
    return {"base": base, "adapter": out / "adapter_final", "merged": out / "merged"}


def test_an_adapter_with_added_tokens_scores_as_its_merged_model(chatml_run, tasks, monkeypatch):
    """The adapter on its base grown to the run's vocabulary == the merged model, document by document
    (each choice's log-likelihood), on prompts that hold the added markers; the base itself is scored
    with the run's tokenizer, on the rows the run started from."""
    from pipeline.evaluate import benchmarks
    from pipeline.planning.benchmarks import BenchTask

    for key, value in OFFLINE_ENV.items():
        monkeypatch.setenv(key, value)
    task = BenchTask("local_choice", str(tasks["root"] / "local.yaml"), None, None, True, local=True)
    scored = {}
    for name, kwargs in [("adapter", {"weights": chatml_run["adapter"]}), ("merged", {"weights": chatml_run["merged"]}),
                         ("base", {"weights": chatml_run["base"]["model"], "tokenizer": chatml_run["base"]["tokenizer"]})]:
        results, chat = benchmarks.evaluate(kwargs.pop("weights"), task, batch_size=4, **kwargs)
        assert chat
        scored[name] = results
    adapter, merged = (scored[k]["samples"]["local_choice"] for k in ("adapter", "merged"))
    assert len(adapter) == len(merged) == len(tasks["docs"])
    for a, m in zip(adapter, merged):
        assert a["doc_id"] == m["doc_id"] and "<|im_start|>" in a["arguments"][0][0]  # the added marker is in the prompt
        for (ll_a, _), (ll_m, _) in zip(a["filtered_resps"], m["filtered_resps"]):
            assert abs(ll_a - ll_m) <= 1e-4 * max(1.0, abs(ll_m)), (a["doc_id"], ll_a, ll_m)
    assert scored["adapter"]["results"]["local_choice"]["acc,none"] == scored["merged"]["results"]["local_choice"]["acc,none"]
    # the adapter's trained rows matter: the base (mean rows for the markers) scores differently
    base = scored["base"]["samples"]["local_choice"]
    assert any(abs(b["filtered_resps"][0][0] - m["filtered_resps"][0][0]) > 1e-3 for b, m in zip(base, merged))
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"
