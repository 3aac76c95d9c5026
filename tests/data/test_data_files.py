"""File kinds: JSON, JSON Lines, Parquet and Arrow read alike, chosen by name and confirmed by content.

The Parquet and Arrow fixtures are written by pyarrow and by `datasets` themselves
(never by our code), as a user's tools would write them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data import readers
from pipeline.data.cache import TokenCache
from pipeline.data.formats import parse_file
from pipeline.data.tokenize import load_tokenizer, tokenize_file
from pipeline.data.validate import validate_dataset


def _record(i: int) -> dict:
    turns = [{"role": "user", "content": f"repeat: w{i}"}, {"role": "assistant", "content": f"w{i}"}]
    record = {"id": f"r{i}", "messages": turns}
    if i % 3 == 0:  # a column that is null in most rows: left out of those records, as in JSON Lines
        record["system"] = "you copy words."
    return record


RECORDS = [_record(i) for i in range(7)]


def _columnar(records: list[dict]) -> list[dict]:
    """What a table holds: every column in every row (null where a record lacks it)."""
    return [{"system": None, **r} for r in records]


def write_kind(directory: Path, kind: str, records: list[dict] = RECORDS) -> Path:
    """`records` as a dataset of `kind`, written by the tool that owns the format."""
    if kind == "json":
        path = directory / "d.json"
        path.write_text(json.dumps(records))
    elif kind == "jsonl":
        path = directory / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif kind == "parquet":
        path = directory / "d.parquet"
        pq.write_table(pa.Table.from_pylist(_columnar(records)), path, row_group_size=3)  # several row groups
    elif kind == "arrow-file":
        path = directory / "d.arrow"
        with pa.ipc.new_file(path, (table := pa.Table.from_pylist(_columnar(records))).schema) as writer:
            writer.write_table(table, max_chunksize=2)
    elif kind == "arrow-dir":
        datasets = pytest.importorskip("datasets")  # in the dev extra
        path = directory / "saved"
        datasets.Dataset.from_list(_columnar(records)).save_to_disk(str(path))
    return path


KINDS = ["json", "jsonl", "parquet", "arrow-file", "arrow-dir"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_reads_the_same_records(tmp_path, kind):
    parsed = parse_file(write_kind(tmp_path, kind))
    assert parsed.problems == []
    assert parsed.layout == kind.split("-")[0]
    reference = parse_file(write_kind(tmp_path, "jsonl"))
    assert [(r.id, r.index, r.messages) for r in parsed.records] == [
        (r.id, r.index, r.messages) for r in reference.records]
    assert parsed.records[0].messages[0] == {"role": "system", "content": "you copy words."}
    assert parsed.records[1].messages[0]["role"] == "user"  # the null system column is no system prompt


def test_columnar_records_are_streamed_in_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "BATCH_ROWS", 2)
    path = write_kind(tmp_path, "parquet", [_record(i) for i in range(11)])
    reader = readers.read_raw(path, "parquet", [])
    first = next(reader)  # a generator: nothing beyond the first batch is read yet
    assert first[1]["id"] == "r0"
    assert [raw["id"] for _, raw in reader] == [f"r{i}" for i in range(1, 11)]


@pytest.mark.parametrize("kind", ["parquet", "arrow-dir"])
def test_validation_and_tokenization_read_columnar_files(tmp_path, tokenizer_dir, kind):
    path = write_kind(tmp_path, kind)
    report = validate_dataset(path, tokenizer_dir=tokenizer_dir, max_length=128, too_long="error")
    assert report.ok, report.summary()
    assert report.files["train"]["kind"] == kind.split("-")[0]
    assert report.files["train"]["records"] == len(RECORDS)
    tokenizer = load_tokenizer(tokenizer_dir)
    caches = {}
    for name, source in (("jsonl", write_kind(tmp_path, "jsonl")), (kind, path)):
        stats = tokenize_file(source, tokenizer, out_path=tmp_path / f"{name}.safetensors", max_length=128,
                              too_long="error", fingerprint="f", split="train")
        assert stats["source_sha256"] == readers.fingerprint(source)
        caches[name] = TokenCache(tmp_path / f"{name}.safetensors")
    assert len(caches[kind]) == len(RECORDS)
    for i in range(len(RECORDS)):
        (ids_a, labels_a), (ids_b, labels_b) = caches["jsonl"][i], caches[kind][i]
        assert np.array_equal(ids_a, ids_b) and np.array_equal(labels_a, labels_b)


# --- the kind is confirmed by the content ---------------------------------------------------------


def test_parquet_named_jsonl_is_refused_naming_what_it_is(tmp_path):
    path = write_kind(tmp_path, "parquet").rename(tmp_path / "d.jsonl")
    (problem,) = parse_file(path).problems
    assert problem.reason == "wrong_kind"
    assert "is a Parquet file" in problem.message and "name it .parquet" in problem.message


def test_text_named_parquet_is_not_parquet(tmp_path):
    path = write_kind(tmp_path, "jsonl").rename(tmp_path / "d.parquet")
    (problem,) = parse_file(path).problems
    assert (problem.reason, problem.file) == ("not_parquet", str(path))
    assert "PAR1" not in problem.message and "magic" in problem.message


def test_unnamed_files_are_read_by_their_content(tmp_path):
    for kind in ("parquet", "json", "jsonl"):
        path = write_kind(tmp_path, kind).rename(tmp_path / f"{kind}.data")
        parsed = parse_file(path)
        assert (parsed.layout, len(parsed.records), parsed.problems) == (kind, len(RECORDS), [])


def test_truncated_parquet_is_one_problem_naming_the_kind(tmp_path):
    path = write_kind(tmp_path, "parquet")
    path.write_bytes(path.read_bytes()[:-40])  # the footer is gone
    (problem,) = parse_file(path).problems
    assert problem.reason == "invalid_parquet" and problem.kind == "parquet"
    assert problem.describe().startswith(f"{path} (Parquet): invalid_parquet: cannot read the Parquet data")


def test_a_dataset_dict_dir_names_its_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(_columnar(RECORDS))
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    (problem,) = parse_file(tmp_path / "dd").problems
    assert problem.reason == "dataset_dict"
    assert "splits: test, train" in problem.message and str(tmp_path / "dd" / "test") in problem.message
    assert parse_file(tmp_path / "dd" / "train").problems == []


def test_a_plain_directory_is_not_a_dataset(tmp_path):
    (tmp_path / "x").mkdir()
    (problem,) = parse_file(tmp_path / "x").problems
    assert problem.reason == "not_a_dataset" and "save_to_disk" in problem.message


def test_columns_of_no_shape_are_one_line_without_reading_rows(tmp_path, monkeypatch):
    path = tmp_path / "qa.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": f"q{i}", "answer": "a"} for i in range(50)]), path)
    monkeypatch.setattr(readers, "read_raw", lambda *a: pytest.fail("rows read"))
    (problem,) = parse_file(path).problems
    assert problem.reason == "unknown_shape" and problem.index is None
    assert "the columns are 'question', 'answer'" in problem.message and "data.columns" in problem.message
