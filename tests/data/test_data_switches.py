"""Every value of the data.* switches runs through the data rules of the DAG (validate + tokenize).

The default run covers each switch's default (too_long: error, duplicates: error, reasoning:
auto, chat_template: null, the embedded train / val / test); the values below run here, several
per run, through ``snakemake results/<run>/data/stats.json`` (prepare_tokenizer, validate_dataset,
tokenize) on the tiny model of `tiny` and small dataset files written here, in one copy of the
workflow: about 15 s per run.

| run | too_long | duplicates | reasoning | chat_template | val / test | shapes, mapping |
|---|---|---|---|---|---|---|
| truncate | truncate | warn | keep | built-in chatml | null / null | messages |
| drop | drop | drop | drop | a .jinja file | a file / null | alpaca with data.columns |
| text | error | error | auto | null | a file / a file | text (train), messages with data.roles |
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from kits.run import copy_workflow, snakemake

WORDS = [f"word{i} and more" for i in range(10)]
LONG = "x" * 120  # over max_length 64 with any template


def _jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _messages(question: str, answer: str, **assistant) -> dict:
    return {"messages": [{"role": "user", "content": f"say {question}"},
                         {"role": "assistant", "content": answer, **assistant}]}


def _datasets(root: Path) -> dict[str, dict]:
    """Each run's data.* settings, with the files they name written under `root`."""
    root.mkdir(parents=True, exist_ok=True)
    chat = [_messages(w, w) for w in WORDS]
    template = root / "plain.jinja"  # a user's own template file: role markers as text, the eos closes a turn
    template.write_text("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token + '\\n' }}{% endfor %}"
                        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    alpaca = [{"question": f"say {w}", "answer": f"<think>\nit is {w}\n</think>\n\n{w}"} for w in WORDS]
    return {
        "truncate": {
            "train": _jsonl(root / "truncate_train.jsonl", chat + [chat[0], _messages("long", LONG,
                                                                                        reasoning_content="why")]),
            "val": None, "test": None, "too_long": "truncate", "duplicates": "warn", "reasoning": "keep",
            "chat_template": "chatml", "max_length": 64,
        },
        "drop": {
            "train": _jsonl(root / "drop_train.jsonl", alpaca + [alpaca[1], {"question": "say x", "answer": LONG}]),
            "val": _jsonl(root / "drop_val.jsonl", [{"question": "say val", "answer": "val"}]),
            "test": None, "too_long": "drop", "duplicates": "drop", "reasoning": "drop",
            "chat_template": str(template), "max_length": 64,
            "columns": {"instruction": "question", "output": "answer"},
        },
        "text": {
            "train": _jsonl(root / "text_train.jsonl", [{"text": f"{w} is a word."} for w in WORDS]),
            "val": _jsonl(root / "text_val.jsonl", [{"messages": [{"role": "customer", "content": "say val"},
                                                                  {"role": "agent", "content": "val"}]}]),
            "test": _jsonl(root / "text_test.jsonl", [_messages("test", "test")]),
            "roles": {"customer": "user", "agent": "assistant"}, "max_length": 64,
        },
    }


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory) -> dict[str, Path]:
    """Each run's results/<run>/ after `snakemake results/<run>/data/stats.json` (one workflow copy)."""
    workdir = copy_workflow(tmp_path_factory.mktemp("switches"))
    out = {}
    for run, data in _datasets(workdir / "datasets").items():
        config = workdir / f"{run}.yaml"
        config.write_text(yaml.safe_dump({"run": run, "model": str(tiny["model"]), "data": data}))
        proc = snakemake(workdir, f"results/{run}/data/stats.json", "--cores", "1", "--configfile", config.name,
                         timeout=300)
        assert proc.returncode == 0, f"run {run}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        out[run] = workdir / "results" / run
    return out


def _reports(results: Path) -> tuple[dict, dict, dict]:
    data = results / "data"
    return (json.loads((data / "validation.json").read_text()), json.loads((data / "stats.json").read_text()),
            json.loads((results / "tokenizer" / "chat.json").read_text()))


def test_truncate_warn_keep_builtin_template_no_val_no_test(runs):
    validation, stats, chat = _reports(runs["truncate"])
    assert chat["template"] == "builtin:chatml" and "<|im_start|>" in chat["added_tokens"]
    assert validation["settings"]["too_long"] == "truncate" and validation["settings"]["reasoning"] == "keep"
    assert set(validation["files"]) == {"train"} and set(stats["splits"]) == {"train"}  # val and test skipped
    assert [w["reason"] for w in validation["warnings"]][:1] == ["duplicate_sample"]  # kept under warn
    train = stats["splits"]["train"]
    assert (train["records"], train["truncated"], train["duplicates_dropped"]) == (12, 1, 0)
    assert train["reasoning_records"] == 1 and train["tokens_per_record"]["max"] == 64


def test_drop_drop_drop_template_file_and_columns(runs):
    validation, stats, chat = _reports(runs["drop"])
    assert chat["template"].startswith("file:") and chat["template"].endswith("plain.jinja")
    assert validation["settings"]["columns"] == {"instruction": "question", "output": "answer"}
    assert set(stats["splits"]) == {"train", "val"}
    train = stats["splits"]["train"]
    assert (train["records_in"], train["duplicates_dropped"], train["dropped"], train["records"]) == (12, 1, 1, 10)
    assert train["reasoning_records"] == 10 and train["reasoning_dropped"] == 10  # reasoning: drop
    assert validation["files"]["train"]["reasoning_dropped_by_policy"] == 10


def test_text_records_and_roles_mapping(runs, tiny):
    from transformers import AutoTokenizer

    from pipeline.data.cache import IGNORE_INDEX, TokenCache

    validation, stats, chat = _reports(runs["text"])
    assert validation["ok"] and set(validation["files"]) == {"train", "val", "test"}
    assert validation["settings"]["roles"] == {"customer": "user", "agent": "assistant"}
    train = stats["splits"]["train"]
    assert train["records"] == 10 and train["assistant_turns"] == 0
    assert train["supervised_tokens"] == train["tokens"]  # plain text: all of it trained (no BOS added)
    tokenizer = AutoTokenizer.from_pretrained(runs["text"] / "tokenizer")
    ids, labels = (t.numpy() for t in TokenCache(runs["text"] / "data" / "train" / "train" / "train.safetensors")[0])
    assert tokenizer.decode(ids) == f"{WORDS[0]} is a word.{tokenizer.eos_token}" and (labels != IGNORE_INDEX).all()
    assert stats["splits"]["val"]["assistant_turns"] == 1
