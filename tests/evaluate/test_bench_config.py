"""`evaluate.benchmarks` as the workflow reads it (pipeline/planning/benchmarks.py): the tasks, the cache
keys Snakemake compares (content, not text or mtimes), the files a job's scores depend on, and every
problem named by its key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import layout
from pipeline.demo import benchmark as demo_bench
from pipeline.planning import benchmarks as bench

SECTION = {"tasks": [], "weights": ["base", "merged"], "num_fewshot": None, "limit": None, "batch_size": 8,
           "chat_template": True}
TASK = """task: rot_choice
include: common.yaml
dataset_kwargs:
  data_files:
    test: {data}
process_docs: !function utils.process_docs
"""
COMMON = """dataset_path: json
output_type: multiple_choice
test_split: test
doc_to_text: "{{q}}"
doc_to_choice: choices
doc_to_target: answer
"""


@pytest.fixture
def user_task(tmp_path) -> dict:
    """A task YAML of a user's own: it includes another, names a Python function and reads local data."""
    root = tmp_path / "tasks"
    root.mkdir()
    data = root / "docs.jsonl"
    data.write_text(json.dumps({"q": "repeat: ab", "choices": ["ab", "ba"], "answer": 0}) + "\n")
    (root / "common.yaml").write_text(COMMON)
    (root / "utils.py").write_text("def process_docs(ds):\n    return ds\n")
    (root / "rot.yaml").write_text(TASK.format(data=data))
    return {"yaml": root / "rot.yaml", "data": data, "common": root / "common.yaml", "utils": root / "utils.py"}


def _task(path: Path, **settings) -> bench.BenchTask:
    tasks, problems = bench.tasks_of({**SECTION, "tasks": [{"task": str(path), **settings}]}, Path("unused.yaml"))
    assert not problems, problems
    return tasks[0]


def test_a_task_yaml_is_read_with_its_includes_and_its_files(user_task):
    task = _task(user_task["yaml"])
    assert (task.name, task.local, task.embedded) == ("rot_choice", True, False)
    assert bench.read_task_yaml(user_task["yaml"])["output_type"] == "multiple_choice"  # from the include
    assert set(bench.task_files(user_task["yaml"])) == {user_task["yaml"], user_task["common"], user_task["utils"],
                                                         user_task["data"]}
    assert not bench.self_contained(user_task["yaml"])


def test_the_cache_key_follows_content_not_comments_or_layout(user_task):
    """A param Snakemake compares: a comment or reformatting reruns nothing; the documents, an included
    YAML, the task's code, the lm-eval version and the few-shot count each rerun the task."""
    key = lambda task=None, version="0.4.13": bench.fingerprint(task or _task(user_task["yaml"]), version)  # noqa: E731
    first = key()
    yaml_text = user_task["yaml"].read_text()
    user_task["yaml"].write_text("# my task\n" + yaml_text.replace("task: rot_choice", "task:   rot_choice  # renamed?"))
    assert key() == first
    changes = {}
    for name, path, edit in [("documents", user_task["data"], lambda t: t.replace('"ab", "ba"', '"ab", "bb"')),
                             ("included YAML", user_task["common"], lambda t: t + "num_fewshot: 2\n"),
                             ("task code", user_task["utils"], lambda t: t + "# changed\nX = 1\n")]:
        original = path.read_text()
        path.write_text(edit(original))
        changes[name] = key()
        path.write_text(original)
    changes["lm-eval version"] = key(version="0.4.14")
    changes["few-shot"] = key(_task(user_task["yaml"], num_fewshot=5))
    assert key() == first and len(set(changes.values()) | {first}) == len(changes) + 1, changes
    # The demo task's files are job inputs, made by a job: its key cannot read them at load time.
    embedded = bench.tasks_of({**SECTION, "tasks": ["embedded"]}, Path("nowhere/repeat_choice.yaml"))[0][0]
    assert embedded.embedded and bench.fingerprint(embedded, "0.4.13", content=False)


def test_problems_name_their_keys(tmp_path, user_task):
    (tmp_path / "noname.yaml").write_text("dataset_path: json\n")
    (tmp_path / "nodata.yaml").write_text("task: nodata\ndataset_path: json\ndataset_kwargs: {data_files: {test: gone.jsonl}}\n")
    section = {**SECTION, "tasks": ["mmlu", "missing/task.yaml", str(tmp_path / "noname.yaml"),
                                    str(tmp_path / "nodata.yaml"), {"task": "mmlu", "num_fewshot": 5}, "bad name!"]}
    tasks, problems = bench.tasks_of(section, Path("unused.yaml"))
    text = "\n".join(problems)
    assert "evaluate.benchmarks.tasks[1]: missing/task.yaml does not exist" in text
    assert "evaluate.benchmarks.tasks[2]" in text and "names no task" in text
    assert "evaluate.benchmarks.tasks[3]" in text and "gone.jsonl, which does not exist" in text
    assert "evaluate.benchmarks.tasks: mmlu is listed twice" in text
    assert "'bad name!' is not usable as a file name" in text
    assert [t for t in tasks if t.name == "mmlu"][1].num_fewshot == 5  # an entry's own setting wins
    assert bench.weights_problems(["base", "adapter_ema", "adapter_best_ema"], has_ema=False, has_val=False) == [
        "evaluate.benchmarks.weights: adapter_ema needs EMA weights (the trainer's ema.rates is empty)",
        "evaluate.benchmarks.weights: adapter_best_ema needs EMA weights (the trainer's ema.rates is empty)",
        "evaluate.benchmarks.weights: adapter_best_ema needs a validation set (data.val is null)"]
    assert bench.vision_language_problem(None, "vlm") and bench.vision_language_problem(None, "text") is None
    (tmp_path / "llava").mkdir()
    (tmp_path / "llava" / "config.json").write_text(json.dumps({"model_type": "llava", "vision_config": {}}))
    assert "vision-language" in bench.vision_language_problem(tmp_path / "llava", None)


def test_the_weights_key_reads_what_from_pretrained_reads(tmp_path, user_task):
    """The job's content key: weights, configs, tokenizer; not the card, our run records, hidden files,
    nor a .bin copy beside the safetensors."""
    model = tmp_path / "merged"
    model.mkdir()
    for name, text in [("model.safetensors", "w"), ("config.json", "{}"), ("tokenizer.json", "{}"),
                       ("pytorch_model.bin", "old"), ("README.md", "card"), (".snakemake_timestamp", ""),
                       ("best.json", "{}")]:
        (model / name).write_text(text)
    assert [p.name for p in bench.weights_files(model)] == ["config.json", "model.safetensors", "tokenizer.json"]
    task = _task(user_task["yaml"])
    key = bench.content_key([model], task, "0.4.13")
    (model / "README.md").write_text("card with benchmark scores")
    assert bench.content_key([model], task, "0.4.13") == key
    (model / "model.safetensors").write_text("w2")
    assert bench.content_key([model], task, "0.4.13") != key


def test_the_workflow_view_lists_results_inputs_and_flags():
    section = {**SECTION, "tasks": ["embedded", {"task": "gsm8k", "num_fewshot": 5, "limit": 0.5}],
               "weights": ["base", "merged", "adapter_ema"]}
    view = bench.Benchmarks(section, run="demo", variants=["demo/variants/a", "demo/variants/b"], demo="embedded")
    assert view.results("gsm8k") == [Path("results/demo/eval/bench/base/gsm8k.json")] + [
        Path(f"results/demo/variants/{v}/eval/bench/{w}/gsm8k.json") for v in "ab" for w in ("merged", "adapter_ema")]
    assert view.flags("gsm8k") == "--task gsm8k --chat-template --num-fewshot 5 --limit 0.5"
    demo = layout.RunTree.of("embedded")
    assert view.inputs(layout.DEMO_BENCH_TASK, "merged", "demo/variants/a", model=["m"], tokenizer="tok") == {
        "task": [str(demo.demo_bench_task(".yaml")), str(demo.demo_bench_task(".jsonl"))],
        "weights": Path("results/demo/variants/a/export/merged")}
    assert view.inputs("gsm8k", "adapter_ema", "demo/variants/a", model=["m"], tokenizer="tok")["model"] == ["m"]
    assert view.inputs("gsm8k", "base", None, model=["m"], tokenizer="tok") == {"task": [], "weights": ["m"],
                                                                                "tokenizer": "tok"}
    assert [t.name for t in view.unscored()] == ["gsm8k"]  # not the local demo task; no result yet
    assert bench.Benchmarks(SECTION, run="demo", variants=["demo"], demo="embedded").summary_inputs("demo") == []


def test_the_demo_task_asks_for_the_word_among_three_anagrams(tmp_path):
    docs = demo_bench.documents(["abcd", "aab", "xyz", "qrstu"])
    assert [d["word"] for d in docs] == ["abcd", "xyz", "qrstu"]  # "aab" has only two anagrams
    for doc in docs:
        assert len(set(doc["choices"])) == 4 and doc["choices"][doc["answer"]] == doc["word"]
        assert all(sorted(c) == sorted(doc["word"]) for c in doc["choices"])
    data = tmp_path / "data"
    data.mkdir()
    (data / "test.jsonl").write_text("".join(json.dumps({"conversations": [
        {"from": "human", "value": f"repeat: {w}"}, {"from": "gpt", "value": w}]}) + "\n" for w in ("abcd", "wxyz")))
    yaml_path, docs_path = demo_bench.build_benchmark(data)
    assert yaml_path == data / "bench" / f"{layout.DEMO_BENCH_TASK}.yaml"
    cfg = bench.read_task_yaml(yaml_path)
    assert bench.task_name(cfg) == layout.DEMO_BENCH_TASK and bench.is_local(cfg) and bench.self_contained(yaml_path)
    assert bench.data_files(cfg) == [docs_path] and len(docs_path.read_text().splitlines()) == 2
    assert cfg["doc_to_text"] == "repeat: {{word}}"
