"""Acceptance 1: every file of the malformed corpus is rejected by the validate CLI, case by case.

CASES is the index of the corpus (`tests/data/malformed/`): one fault per file.
Each file is validated by `python -m pipeline validate` in its own process
(forked, two at a time, to keep the suite fast); the exit code, the message,
`validation.json` and `validation.csv`, and their copies in `--failed-report-dir`
(what survives Snakemake deleting a failed job's outputs) are then checked case
by case. A case that is a fault only under another setting (all records too long
under too_long=drop) gets that flag from EXTRA_ARGS. The record-level faults sit
in one-record files so that those runs never have to load the tokenizer (the
slow part of a run); `test_data_formats` re-checks the same records in the
middle of clean files for the record/line locator.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from kits.cli import run_cli_forked

DATA_DIR = Path(__file__).resolve().parent
MALFORMED = DATA_DIR / "malformed"
GOOD = DATA_DIR / "good"
MAX_LENGTH = 128

# file, the slot it is passed as (train/val/test; the others get the good files), reason, locator.
# The locator is what the message must say between the file name and ": <reason>: "
# ("" for a file-level fault).
CASES = [
    # --- the file as a whole
    ("empty.jsonl", "train", "empty_file", ""),
    ("blank_lines.jsonl", "train", "empty_file", ""),
    ("empty_array.json", "train", "no_records", ""),
    ("bad_json_array.json", "train", "invalid_json", " line 24"),
    ("truncated_array.json", "train", "invalid_json", " line 33"),
    ("array_trailing_garbage.json", "train", "invalid_json", " line 29"),
    ("bad_utf8_array.json", "train", "invalid_utf8", " line 33"),
    ("top_level_object.json", "train", "wrong_top_level_type", ""),
    ("top_level_string.json", "train", "wrong_top_level_type", ""),
    # --- one line of a JSONL file (line 1 is blank: line numbers count it, record numbers do not)
    ("bad_json_line.jsonl", "train", "invalid_json", " record 0 (line 2)"),
    ("unterminated_string.jsonl", "train", "invalid_json", " record 1 (line 2)"),
    ("bad_utf8.jsonl", "train", "invalid_utf8", " record 0 (line 2)"),
    # --- record structure
    ("record_not_object.jsonl", "train", "not_object", " record 0 (line 1)"),
    ("record_not_object.json", "train", "not_object", " record 0"),
    # a file in which no record has a shape: one line for the file, naming its keys
    ("missing_conversations.jsonl", "train", "unknown_shape", ""),
    ("both_formats.jsonl", "train", "ambiguous_format", " record 0 (line 1, id 'm-1')"),
    ("conversations_not_list.jsonl", "train", "turns_not_list", " record 0 (line 1, id 'm-1') conversations"),
    ("empty_conversations.jsonl", "train", "empty_turns", " record 0 (line 1, id 'm-1') conversations"),
    ("turn_not_object.jsonl", "train", "turn_not_object", " record 0 (line 1, id 'm-1') conversations[0]"),
    ("unknown_role.jsonl", "train", "unknown_role", " record 0 (line 1, id 'm-1') conversations[1].from"),
    ("missing_role.json", "train", "unknown_role", " record 0 (id 'o-1') messages[0].role"),
    ("consecutive_users.jsonl", "train", "bad_role_order", " record 0 (line 1, id 'm-1') conversations[1].from"),
    ("system_in_middle.json", "train", "bad_role_order", " record 0 (id 'o-1') messages[1].role"),
    ("starts_with_assistant.jsonl", "train", "bad_role_order", " record 0 (line 1, id 'm-1') conversations[0].from"),
    ("empty_text.jsonl", "train", "empty_text", " record 0 (line 1, id 'm-1') conversations[1].value"),
    ("blank_text.json", "train", "empty_text", " record 0 (id 'o-1') messages[0].content"),
    ("text_not_string.json", "train", "text_not_string", " record 0 (id 'o-1') messages[1].content"),
    ("no_assistant.jsonl", "train", "no_assistant_turn", " record 0 (line 1, id 'm-1') conversations"),
    ("bad_system.jsonl", "train", "bad_system", " record 0 (line 1, id 'm-1') system"),
    ("bad_id.jsonl", "train", "bad_id", " record 0 (line 1) id"),
    ("bad_image_field.jsonl", "train", "bad_image_field", " record 0 (line 1, id 'm-1') image"),
    # --- images (paths relative to the dataset file)
    ("image_missing.jsonl", "train", "image_missing", " record 1 (line 2, id 'm-1') image[0]"),
    ("image_corrupt.jsonl", "train", "image_undecodable", " record 1 (line 2, id 'm-1') image[0]"),
    ("image_empty.jsonl", "train", "image_undecodable", " record 1 (line 2, id 'm-1') image[0]"),
    ("image_too_small.jsonl", "train", "image_size", " record 1 (line 2, id 'm-1') image[0]"),
    ("image_placeholder_missing.jsonl", "train", "image_placeholder_mismatch", " record 1 (line 2, id 'm-1') image"),
    ("image_placeholder_extra.json", "train", "image_placeholder_mismatch", " record 0 (id 'o-1') messages"),
    ("image_in_assistant_turn.jsonl", "train", "image_outside_user_turn",
     " record 0 (line 1, id 'm-1') conversations[1].value"),
    ("image_remote.json", "train", "bad_image_field", " record 0 (id 'o-1') messages[0].content[0]"),
    ("bad_content_part.json", "train", "bad_content_part", " record 0 (id 'o-1') messages[0].content[0]"),
    # --- length, duplicates, leakage between splits
    ("too_long.jsonl", "train", "too_long", " record 1 (line 2, id 'm-1')"),
    ("all_too_long.jsonl", "train", "no_usable_records", ""),  # under too_long=drop (EXTRA_ARGS)
    ("duplicate_id.jsonl", "train", "duplicate_id", " record 1 (line 2, id 'm-0') id"),
    ("duplicate_sample.jsonl", "train", "duplicate_sample", " record 1 (line 2, id 'm-9')"),
    ("overlap_val.jsonl", "val", "split_overlap", " record 1 (line 2, id 'v-1')"),
    ("overlap_test.jsonl", "test", "split_overlap", " record 1 (line 2, id 't-1')"),
]
_KIND = {".json": "JSON", ".jsonl": "JSON Lines"}
GOOD_FILES = {"train": GOOD / "train.jsonl", "val": GOOD / "val.json", "test": GOOD / "test.jsonl"}
# Cases that are faults only under a non-default setting: appended to the command (the last flag wins).
EXTRA_ARGS = {"all_too_long.jsonl": ["--too-long", "drop"]}


def _validate_args(tokenizer_dir: Path, out: Path, files: dict[str, Path], extra=()) -> list:
    out.mkdir(parents=True, exist_ok=True)
    args = ["validate", "--tokenizer", tokenizer_dir, "--max-length", MAX_LENGTH, "--too-long", "error",
            "--duplicates", "error", "--reasoning", "auto", "--out-json", out / "validation.json", "--out-csv", out / "validation.csv",
            "--failed-report-dir", out / "failed"]
    for slot, path in files.items():
        args += [f"--{slot}", path]
    return [*args, *extra]


def _outcome(proc, out: Path):
    report = json.loads((out / "validation.json").read_text()) if (out / "validation.json").exists() else None
    table = pd.read_csv(out / "validation.csv") if (out / "validation.csv").exists() else None
    return proc, report, table


@pytest.fixture(scope="module")
def runs(tiny_llava, tmp_path_factory):
    """All corpus runs plus the good dataset, keyed by file name ('good' for the clean run).

    Validated for a vision-language model (tiny LLaVA): the good dataset has a record with an
    image, which a text-only model refuses (`images_on_text_model`). Each run is the CLI in a
    process of its own, forked from this one (`run_cli_forked`: the same exit code and output as
    `python -m pipeline validate`, without ~3 s of interpreter start and imports a run).
    """
    tokenizer_dir = tiny_llava["model"]
    root = tmp_path_factory.mktemp("corpus")
    jobs = {"good": dict(GOOD_FILES)}
    for name, slot, _, _ in CASES:
        files = {"train": GOOD_FILES["train"]} if slot != "train" else {}
        files[slot] = MALFORMED / name
        jobs[name] = files
    procs = run_cli_forked({name: _validate_args(tokenizer_dir, root / name, files, EXTRA_ARGS.get(name, ()))
                            for name, files in jobs.items()})
    return {name: _outcome(procs[name], root / name) for name in jobs}, root


def test_corpus_index_lists_every_file():
    on_disk = {p.name for p in MALFORMED.iterdir() if p.is_file()}
    listed = [name for name, *_ in CASES]
    assert len(listed) == len(set(listed))
    assert on_disk == set(listed)
    assert len(listed) >= 25


def test_good_dataset_passes(runs):
    results, root = runs
    proc, report, table = results["good"]
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert report["ok"] is True and report["num_problems"] == 0
    assert set(report["files"]) == {"train", "val", "test"}
    assert report["files"]["train"]["records"] == 5
    assert report["files"]["train"]["images"] == 1
    assert len(table) == 0 and "reason" in table.columns
    assert not (root / "good" / "failed").exists()


@pytest.mark.parametrize(("name", "slot", "reason", "where"), CASES, ids=[c[0] for c in CASES])
def test_malformed_file_is_rejected(runs, name, slot, reason, where):
    results, root = runs
    proc, report, table = results[name]
    path = str(MALFORMED / name)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: dataset validation failed")
    # The message names the file, its kind, the record (index / line / id, field) and the reason.
    assert f"{path} ({_KIND[Path(name).suffix]}){where}: {reason}: " in proc.stderr
    assert "1 problem(s)" in proc.stderr
    # Both reports are written on failure, and hold exactly the one fault.
    assert report["ok"] is False
    assert report["counts"] == {reason: 1}
    (problem,) = report["problems"]
    assert problem["file"] == path and problem["split"] == slot
    assert table[["file", "reason", "split"]].values.tolist() == [[path, reason, slot]]
    # The last line names the copies Snakemake does not delete with a failed job's outputs.
    failed = root / name / "failed"
    assert proc.stderr.splitlines()[-1] == f"full report: {failed / 'validation.json'} and {failed / 'validation.csv'}"
    assert json.loads((failed / "validation.json").read_text()) == report
    assert pd.read_csv(failed / "validation.csv").equals(table)
