"""Validation in process: collecting every problem, the too-long policies, reports, images."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest

from pipeline.data import validate as v
from pipeline.errors import DataError, UserError

HERE = Path(__file__).resolve().parent
GOOD = HERE / "good"


def sample(i: int, answer: str | None = None, **extra) -> dict:
    word = f"w{i}"
    return {"id": f"r{i}", "conversations": [
        {"from": "human", "value": f"repeat: {word}"}, {"from": "gpt", "value": answer or word}], **extra}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_main(tmp_path, tokenizer_dir, *extra) -> list[str]:
    return ["--tokenizer", str(tokenizer_dir), "--out-json", str(tmp_path / "v.json"),
            "--out-csv", str(tmp_path / "v.csv"), *map(str, extra)]


def test_every_problem_is_collected_and_the_summary_is_capped(tmp_path, tokenizer_dir):
    records = [sample(i) for i in range(30)]
    for i in range(0, 25):
        records[i]["conversations"][1]["value"] = ""  # 25 faults of one kind...
    records[26]["id"] = "r27"  # ...and one more of another, late in the file
    train = write_jsonl(tmp_path / "train.jsonl", records)
    with pytest.raises(DataError) as err:
        v.main(run_main(tmp_path, tokenizer_dir, "--train", train, "--max-length", 128, "--too-long", "error"))
    message = str(err.value)
    assert "(duplicate_id: 1, empty_text: 25): 26 problem(s)" in message
    assert message.count("empty_text: text is missing") == 20  # the first 20 problems are listed
    assert "... and 6 more" in message
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["ok"] is False and report["num_problems"] == 26
    assert report["files"]["train"]["records_valid"] == 4
    table = pd.read_csv(tmp_path / "v.csv")
    assert list(table.columns) == v.CSV_COLUMNS
    assert len(table) == 26
    assert table.loc[table.reason == "duplicate_id", ["index", "line", "id", "field"]].values.tolist() == [
        [27, 28, "r27", "id"]]


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_truncate_and_drop_count_over_long_records_without_failing(tmp_path, tokenizer_dir, policy, capsys):
    train = write_jsonl(tmp_path / "train.jsonl", [sample(0), sample(1, answer="x" * 200), sample(2)])
    args = run_main(tmp_path, tokenizer_dir, "--train", train, "--max-length", 64, "--too-long", policy)
    assert v.main(args) == 0
    stats = json.loads((tmp_path / "v.json").read_text())["files"]["train"]
    assert stats["too_long"] == 1 and stats["truncated" if policy == "truncate" else "dropped"] == 1
    assert stats["tokens_per_record"]["max"] > 64
    assert "1 over max_length" in capsys.readouterr().out


def test_error_policy_makes_over_long_records_problems(tmp_path, tokenizer_dir):
    train = write_jsonl(tmp_path / "train.jsonl", [sample(0), sample(1, answer="x" * 200)])
    report = v.validate_dataset(train, tokenizer_dir=tokenizer_dir, max_length=64, too_long="error")
    assert [(p.index, p.reason) for _, p in report.problems] == [(1, "too_long")]
    assert "tokens > max_length 64" in report.problems[0][1].message


def test_template_failures_are_problems(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer

    tok_dir = tmp_path / "tok"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = "{{ raise_exception('no system role') if messages[0]['role'] == 'system' }}" + \
        tokenizer.chat_template
    tokenizer.save_pretrained(tok_dir)
    train = write_jsonl(tmp_path / "train.jsonl", [sample(0), sample(1, system="be nice")])
    report = v.validate_dataset(train, tokenizer_dir=tok_dir, max_length=128, too_long="error")
    ((_, problem),) = report.problems
    assert (problem.index, problem.reason) == (1, "template_error")
    assert "no system role" in problem.message


def test_duplicates_are_exact_but_overlap_ignores_whitespace(tmp_path, tokenizer_dir):
    spaced = sample(1)
    spaced["conversations"][0]["value"] = " repeat:  w1\n"
    train = write_jsonl(tmp_path / "train.jsonl", [sample(0), sample(1), {**spaced, "id": "s"}])
    val = write_jsonl(tmp_path / "val.jsonl", [{**spaced, "id": "v"}, sample(9)])
    report = v.validate_dataset(train, val=val, tokenizer_dir=tokenizer_dir, max_length=128, too_long="error")
    # within train, the spaced copy is not an exact duplicate; across splits it is an overlap
    assert [(split, p.index, p.reason) for split, p in report.problems] == [("val", 0, "split_overlap")]


def test_unloadable_tokenizer_is_a_user_error(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [sample(0)])
    with pytest.raises(UserError, match="tokenizer directory not found"):
        v.validate_dataset(train, tokenizer_dir=tmp_path / "nope", max_length=128, too_long="error")
    with pytest.raises(UserError, match="cannot load a tokenizer"):
        v.validate_dataset(train, tokenizer_dir=tmp_path, max_length=128, too_long="error")


def test_image_check_without_pillow_uses_magic_numbers(tmp_path, monkeypatch):
    good = str(GOOD / "images" / "red.png")
    empty = str(HERE / "malformed" / "images" / "empty.png")
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    assert v.check_image(good) is None
    assert v.check_image(str(text))[0] == "image_undecodable"
    monkeypatch.setitem(sys.modules, "PIL", None)  # `from PIL import Image` now raises ImportError
    assert v.check_image(good) is None
    assert v.check_image(empty)[0] == "image_undecodable"
    assert v.check_image(str(text))[0] == "image_undecodable"
    assert v.check_image(str(tmp_path / "absent.png"))[0] == "image_missing"
