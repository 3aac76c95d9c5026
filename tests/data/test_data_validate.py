"""Validation in process: collecting every problem, the too-long policies, reports, images."""

from __future__ import annotations

import json
import os
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
    # The policies the workflow passes by default (a later --duplicates / --reasoning in extra wins).
    return ["--tokenizer", str(tokenizer_dir), "--duplicates", "error", "--reasoning", "auto", "--out-json", str(tmp_path / "v.json"),
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


def test_samples_of_one_question_with_different_reasoning_are_not_duplicates(tmp_path, tokenizer_dir):
    """Reasoning data samples one question many times (OpenThoughts, rejection sampling): the samples differ only in
    `reasoning_content`, and each is trained. An exact copy is still a duplicate; in another split, the same question
    and answer is an overlap whatever the reasoning (the model has seen the answer)."""
    def solved(how: str, record_id: str) -> dict:
        return {"id": record_id, "messages": [{"role": "user", "content": "What is 17 * 3?"},
                                              {"role": "assistant", "content": "51", "reasoning_content": how}]}
    train = write_jsonl(tmp_path / "train.jsonl", [solved("17 * 3 = 10 * 3 + 7 * 3 = 30 + 21", "a"),
                                                   solved("17 + 17 + 17 = 51", "b"),
                                                   solved("17 + 17 + 17 = 51", "c")])
    val = write_jsonl(tmp_path / "val.jsonl", [solved("3 * 17 = 51", "v")])
    report = v.validate_dataset(train, val=val, tokenizer_dir=tokenizer_dir, max_length=256, too_long="error")
    assert [(split, p.index, p.reason) for split, p in report.problems] == [("train", 2, "duplicate_sample"),
                                                                            ("val", 0, "split_overlap")]


def test_unloadable_tokenizer_is_a_user_error(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [sample(0)])
    with pytest.raises(UserError, match="tokenizer directory not found"):
        v.validate_dataset(train, tokenizer_dir=tmp_path / "nope", max_length=128, too_long="error")
    with pytest.raises(UserError, match="cannot load a tokenizer"):
        v.validate_dataset(train, tokenizer_dir=tmp_path, max_length=128, too_long="error")


def test_image_check_decodes_the_whole_file_and_bounds_its_size(tmp_path):
    from PIL import Image

    from pipeline.data.images import check_image

    good = tmp_path / "ok.png"
    Image.new("RGB", (32, 24), (200, 10, 10)).save(good)
    assert check_image(str(good)) is None
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    assert check_image(str(text))[0] == "image_undecodable"
    truncated = tmp_path / "cut.jpg"  # a valid header, half the data: only decoding it finds out
    Image.effect_noise((64, 64), 50).convert("RGB").save(tmp_path / "full.jpg")
    truncated.write_bytes((tmp_path / "full.jpg").read_bytes()[:600])
    assert check_image(str(truncated))[0] == "image_undecodable"
    assert check_image(str(tmp_path / "absent.png"))[0] == "image_missing"
    for size, why in (((3, 32), "under 4 px"), ((4000, 16), "aspect ratio over 200")):
        path = tmp_path / f"{size[0]}x{size[1]}.png"
        Image.new("RGB", size).save(path)
        reason, message = check_image(str(path))
        assert reason == "image_size" and why in message and f"{size[0]}x{size[1]}" in message


# --- the duplicates policy ------------------------------------------------------------------------


def _with_copy(tmp_path) -> Path:
    """r0, r1, r2 where r2 repeats r0's conversation under its own id."""
    copy = {**sample(0), "id": "r2"}
    return write_jsonl(tmp_path / "train.jsonl", [sample(0), sample(1), copy])


def test_duplicates_error_is_the_default(tmp_path, tokenizer_dir):
    report = v.validate_dataset(_with_copy(tmp_path), tokenizer_dir=tokenizer_dir, max_length=128, too_long="error")
    assert [(p.index, p.reason, p.message) for _, p in report.problems] == [
        (2, "duplicate_sample", "same conversation as record 0")]
    assert report.settings["duplicates"] == "error"


def test_duplicates_warn_keeps_and_counts_them(tmp_path, tokenizer_dir):
    report = v.validate_dataset(_with_copy(tmp_path), tokenizer_dir=tokenizer_dir, max_length=128,
                                too_long="error", duplicates="warn")
    assert report.ok
    assert [(split, p.index, p.reason) for split, p in report.warnings] == [("train", 2, "duplicate_sample")]
    stats = report.files["train"]
    assert (stats["duplicates"], stats["duplicates_dropped"], stats["records_usable"]) == (1, 0, 3)
    assert report.to_json()["warnings"][0]["id"] == "r2"


def test_duplicates_warn_prints_one_warning_line_per_split(tmp_path, tokenizer_dir, capsys):
    train = _with_copy(tmp_path)
    assert v.main(run_main(tmp_path, tokenizer_dir, "--train", train, "--max-length", 128, "--too-long", "error",
                           "--duplicates", "warn")) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        f"warning: train: 1 duplicate conversation(s) kept (duplicates=warn); first: {train} (JSON Lines) record 2 (line 3, "
        "id 'r2'): duplicate_sample: same conversation as record 0"]
    assert out == f"train: 3 records ok ({train}, JSON Lines), 1 duplicate(s) kept\n"


def test_duplicates_drop_counts_them_and_checks_only_the_kept_records(tmp_path, tokenizer_dir, capsys):
    copy = {**sample(1, answer="x" * 200), "id": "r2"}  # an over-long copy: dropped before it is measured
    train = write_jsonl(tmp_path / "train.jsonl", [sample(0), sample(1, answer="x" * 200), copy])
    assert v.main(run_main(tmp_path, tokenizer_dir, "--train", train, "--max-length", 64, "--too-long", "truncate",
                           "--duplicates", "drop")) == 0
    report = json.loads((tmp_path / "v.json").read_text())
    stats = report["files"]["train"]
    assert (stats["records"], stats["duplicates"], stats["duplicates_dropped"]) == (3, 1, 1)
    assert (stats["too_long"], stats["truncated"], stats["records_usable"]) == (1, 1, 2)
    assert report["ok"] is True and report["warnings"] == [] and report["settings"]["duplicates"] == "drop"
    assert capsys.readouterr().out == (
        f"train: 3 records ok ({train}, JSON Lines), 1 over max_length (truncate), 1 duplicate(s) dropped\n")


@pytest.mark.parametrize("policy", ["error", "warn", "drop"])
def test_repeated_ids_are_errors_under_every_policy(tmp_path, tokenizer_dir, policy):
    train = write_jsonl(tmp_path / "train.jsonl", [sample(0), sample(1), sample(0)])  # record 2: same id, same text
    report = v.validate_dataset(train, tokenizer_dir=tokenizer_dir, max_length=128, too_long="error",
                                duplicates=policy)
    found = [(p.index, p.reason) for _, p in report.problems]
    expected = [(2, "duplicate_id"), (2, "duplicate_sample")] if policy == "error" else [(2, "duplicate_id")]
    assert found == expected


def test_unknown_duplicates_policy_is_a_user_error(tmp_path, tokenizer_dir):
    with pytest.raises(UserError, match="duplicates must be one of error, warn, drop, not 'keep'"):
        v.validate_dataset(_with_copy(tmp_path), tokenizer_dir=tokenizer_dir, max_length=128, too_long="error",
                           duplicates="keep")


# --- a split with nothing left to train on --------------------------------------------------------


def test_every_record_over_max_length_under_drop_fails_validation(tmp_path, tokenizer_dir):
    train = write_jsonl(tmp_path / "train.jsonl", [sample(i, answer="x" * 200) for i in range(3)])
    with pytest.raises(DataError) as err:
        v.main(run_main(tmp_path, tokenizer_dir, "--train", train, "--max-length", 64, "--too-long", "drop"))
    assert str(err.value).splitlines()[:2] == [
        "dataset validation failed (no_usable_records: 1): 1 problem(s)",
        f"  {train} (JSON Lines): no_usable_records: no usable record is left: all 3 records are over max_length 64 "
        "and too_long=drop",
    ]
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["ok"] is False and report["files"]["train"]["records_usable"] == 0
    assert report["problems"][0]["file"] == str(train) and report["problems"][0]["index"] is None


def test_no_usable_record_names_every_cause(tmp_path, tokenizer_dir):
    empty = sample(0, answer=" ")  # a problem of its own
    long_ = sample(1, answer="x" * 200)  # over max_length, dropped
    copy = {**long_, "id": "r2"}  # a copy of it, dropped as a duplicate before its length is measured
    train = write_jsonl(tmp_path / "train.jsonl", [empty, long_, copy])
    report = v.validate_dataset(train, tokenizer_dir=tokenizer_dir, max_length=64, too_long="drop",
                                duplicates="drop")
    assert [(p.index, p.reason, p.message) for _, p in report.problems] == [
        (None, "no_usable_records", "no usable record is left: of its 3 records, 1 has a problem, "
         "1 is a copy of an earlier record and duplicates=drop, 1 is over max_length 64 and too_long=drop"),
        (0, "empty_text", "text is missing or blank"),
    ]


def test_a_split_where_every_record_is_broken_gets_a_note_not_an_extra_problem(tmp_path, tokenizer_dir):
    train = write_jsonl(tmp_path / "train.jsonl", [sample(0, answer=" "), sample(1, answer=" ")])
    report = v.validate_dataset(train, tokenizer_dir=tokenizer_dir, max_length=128, too_long="error")
    assert [p.reason for _, p in report.problems] == ["empty_text", "empty_text"]
    assert report.notes == [f"{train}: no usable record is left: all 2 records have problems"]
    assert report.summary().splitlines()[1] == f"  {train}: no usable record is left: all 2 records have problems"


def test_a_split_with_one_usable_record_passes(tmp_path, tokenizer_dir):
    train = write_jsonl(tmp_path / "train.jsonl", [sample(0, answer="x" * 200), sample(1)])
    report = v.validate_dataset(train, tokenizer_dir=tokenizer_dir, max_length=64, too_long="drop")
    assert report.ok and report.files["train"]["records_usable"] == 1


# --- overlap between splits -----------------------------------------------------------------------


def test_val_that_is_train_is_one_line_and_does_not_hide_other_problems(tmp_path, tokenizer_dir):
    train = write_jsonl(tmp_path / "train.jsonl", [sample(i) for i in range(40)])
    test = write_jsonl(tmp_path / "test.jsonl", [sample(i) for i in range(25)] + [sample(99, answer=" ")])
    with pytest.raises(DataError) as err:
        v.main(run_main(tmp_path, tokenizer_dir, "--train", train, "--val", train, "--test", test,
                        "--max-length", 128, "--too-long", "error"))
    lines = str(err.value).splitlines()
    assert lines[:4] == [
        "dataset validation failed (empty_text: 1, split_overlap: 65): 66 problem(s)",
        f"  val: 40 of 40 records also occur in train (same file as train: {train})",
        "  test: 25 of 26 records also occur in train",
        f"  {test} (JSON Lines) record 25 (line 26, id 'r99') conversations[1].value: empty_text: text is missing or blank",
    ]
    assert sum(": split_overlap: " in line for line in lines) == v.OVERLAP_EXAMPLES  # examples, not all 65
    assert lines[4] == f"  {train} (JSON Lines) record 0 (line 1, id 'r0'): split_overlap: same conversation as train record 0"
    assert lines[-2] == f"  ... and {66 - 1 - v.OVERLAP_EXAMPLES} more"
    table = pd.read_csv(tmp_path / "v.csv")
    assert (table.reason == "split_overlap").sum() == 65  # every overlapping record keeps its row
    files = json.loads((tmp_path / "v.json").read_text())["files"]
    assert files["val"]["overlaps"] == {"train": 40} and files["test"]["overlaps"] == {"train": 25}


def test_a_copy_of_train_under_another_name_is_called_a_copy(tmp_path, tokenizer_dir):
    train = write_jsonl(tmp_path / "train.jsonl", [sample(i) for i in range(5)])
    val = tmp_path / "val.jsonl"
    val.write_bytes(train.read_bytes())
    report = v.validate_dataset(train, val=val, tokenizer_dir=tokenizer_dir, max_length=128, too_long="error")
    assert report.notes == [
        f"val: 5 of 5 records also occur in train (val is a copy of train: same content as {train})"]


# --- reports that survive a failure ---------------------------------------------------------------


def test_failed_reports_survive_outside_the_declared_outputs(tmp_path, tokenizer_dir):
    failed = tmp_path / "validation_failed"
    bad = write_jsonl(tmp_path / "train.jsonl", [sample(0), sample(1, answer=" ")])
    args = run_main(tmp_path, tokenizer_dir, "--train", bad, "--max-length", 128, "--too-long", "error",
                    "--failed-report-dir", failed)
    with pytest.raises(DataError) as err:
        v.main(args)
    (tmp_path / "v.json").unlink()  # what Snakemake does to a failed job's declared outputs
    (tmp_path / "v.csv").unlink()
    assert str(err.value).splitlines()[-1] == (
        f"full report: {failed / 'validation.json'} and {failed / 'validation.csv'}")
    assert sorted(p.name for p in failed.iterdir()) == ["validation.csv", "validation.json"]  # no temp files left
    report = json.loads((failed / "validation.json").read_text())
    assert report["ok"] is False and report["counts"] == {"empty_text": 1}
    assert pd.read_csv(failed / "validation.csv")["reason"].tolist() == ["empty_text"]

    write_jsonl(bad, [sample(0), sample(1)])  # the user fixes the data and reruns
    assert v.main(args) == 0
    assert not failed.exists()  # a stale failure would be mistaken for this run's


def test_without_a_failed_report_dir_the_error_names_the_outputs(tmp_path, tokenizer_dir):
    train = write_jsonl(tmp_path / "train.jsonl", [sample(0, answer=" ")])
    with pytest.raises(DataError) as err:
        v.main(run_main(tmp_path, tokenizer_dir, "--train", train, "--max-length", 128, "--too-long", "error"))
    assert str(err.value).splitlines()[-1] == f"full report: {tmp_path / 'v.json'} and {tmp_path / 'v.csv'}"


def test_failed_report_dir_must_not_hold_the_outputs(tmp_path, tokenizer_dir):
    train = write_jsonl(tmp_path / "train.jsonl", [sample(0)])
    args = ["--train", str(train), "--tokenizer", str(tokenizer_dir), "--max-length", "128", "--too-long", "error",
            "--duplicates", "error", "--reasoning", "auto", "--out-json", str(tmp_path / "validation.json"), "--out-csv", str(tmp_path / "v.csv"),
            "--failed-report-dir", str(tmp_path)]
    with pytest.raises(UserError, match="give it a directory of its own"):
        v.main(args)


def test_clearing_stale_reports_keeps_anything_else_in_the_dir(tmp_path):
    failed = tmp_path / "failed"
    failed.mkdir()
    for name in v.REPORT_NAMES + ("notes.txt",):
        (failed / name).write_text("x")
    v.remove_failed_reports(failed)
    assert [p.name for p in failed.iterdir()] == ["notes.txt"]
    v.remove_failed_reports(tmp_path / "absent")  # nothing to clear is fine


def test_reports_are_replaced_atomically(tmp_path, tokenizer_dir, monkeypatch):
    train = write_jsonl(tmp_path / "train.jsonl", [sample(0)])
    report = v.validate_dataset(train, tokenizer_dir=tokenizer_dir, max_length=128, too_long="error")
    out_json, out_csv = tmp_path / "r" / "v.json", tmp_path / "r" / "v.csv"
    v.write_report(report, out_json, out_csv)
    before = out_json.read_text()

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)  # what publish's atomic rename calls
    report.problems.append(("train", v.Problem(str(train), "empty_text", "x", index=0)))
    with pytest.raises(OSError, match="disk full"):
        v.write_report(report, out_json, out_csv)
    assert out_json.read_text() == before  # the old report is whole, not half overwritten
    assert sorted(p.name for p in out_json.parent.iterdir()) == ["v.csv", "v.json"]  # and no temp file is left


def test_vision_language_lengths_count_the_image_tokens(tiny_llava):
    """The demo's records are ~40 text tokens plus 16 image tokens: max_length 48 holds the text only."""
    data = tiny_llava["data"]
    fits = v.validate_dataset(data / "val.jsonl", tokenizer_dir=tiny_llava["model"], max_length=80, too_long="error")
    assert fits.ok, fits.summary()
    report = v.validate_dataset(data / "val.jsonl", tokenizer_dir=tiny_llava["model"], max_length=48, too_long="error")
    assert {p.reason for _, p in report.problems} == {"too_long"}
    assert report.files["train"]["tokens_per_record"]["max"] > 48


def test_same_question_is_a_leak_only_with_the_same_image(tmp_path, tiny_llava):
    from PIL import Image

    for name, color in (("a.png", "red"), ("b.png", "blue")):
        Image.new("RGB", (8, 8), color).save(tmp_path / name)
    (tmp_path / "a_copy.png").write_bytes((tmp_path / "a.png").read_bytes())

    def asked(i: int, image: str) -> dict:
        return {"id": f"q{i}", "image": image, "conversations": [
            {"from": "human", "value": "<image>\nwhat color?"}, {"from": "gpt", "value": "a color"}]}

    train = write_jsonl(tmp_path / "train.jsonl", [asked(0, "a.png"), sample(1)])
    val = write_jsonl(tmp_path / "val.jsonl", [asked(2, "b.png"), asked(3, "a_copy.png")])
    report = v.validate_dataset(train, val=val, tokenizer_dir=tiny_llava["model"], max_length=128, too_long="error")
    assert [(p.index, p.reason, p.message) for _, p in report.problems] == [
        (1, "split_overlap", "same conversation as train record 0")]  # a.png under another name; b.png is new
