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

from pipeline.data import columnar, readers
from pipeline.data.cache import TokenCache
from pipeline.data.formats import FieldMap, parse_file
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
    monkeypatch.setattr(columnar, "BATCH_ROWS", 2)
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
    (tmp_path / "x" / "README.md").write_text("# notes\n")
    (problem,) = parse_file(tmp_path / "x").problems
    assert problem.reason == "not_a_dataset" and "save_to_disk" in problem.message


def test_a_directory_of_shards_reads_as_one_dataset_naming_each_file(tmp_path, tokenizer_dir):
    """A dataset repo's folder as `hf download --local-dir` leaves it: Parquet shards written by `datasets`, a
    README, .gitattributes and hf's .cache/ of download metadata. The shards are one dataset in the order of their
    names, the other files no data; validation names a bad record by its shard and its number there. A folder of
    JSON Lines files with the images their records name is read the same way, and its size for sharding is its data
    files'. A folder holding two splits' shards is one problem naming them."""
    import datasets

    from pipeline.data import shards

    local = tmp_path / "ds" / "data"
    local.mkdir(parents=True)
    rows = _columnar(RECORDS) + [{"system": None, "id": "empty", "messages": []}]
    for k, (start, end) in enumerate(((0, 4), (4, 8))):
        datasets.Dataset.from_list(rows[start:end]).to_parquet(str(local / f"train-{k:05d}-of-00002.parquet"))
    (tmp_path / "ds" / "README.md").write_text("---\nlicense: mit\n---\n")
    (local / ".gitattributes").write_text("*.parquet filter=lfs\n")
    (local / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (local / ".cache" / "huggingface" / "download" / "train-00000-of-00002.parquet.metadata").write_text("x\n")

    parsed = parse_file(local)
    assert parsed.layout == "parquet"
    assert [r.id for r in parsed.records] == [r["id"] for r in RECORDS]
    report = validate_dataset(local, tokenizer_dir=tokenizer_dir, max_length=128, too_long="error")
    (problem,) = [p for _, p in report.problems]
    assert problem.where() == f"{local} (Parquet) record 7 (record 3 of train-00001-of-00002.parquet, id 'empty')"
    assert problem.reason == "empty_turns"

    lines = tmp_path / "lines"
    (lines / "images").mkdir(parents=True)
    from PIL import Image

    Image.new("RGB", (32, 32), "red").save(lines / "images" / "a.png")
    (lines / "images" / "big.bin").write_bytes(b"\0" * 2**20)
    turns = [{"from": "human", "value": "<image>\nwhat colour?"}, {"from": "gpt", "value": "red"}]
    for name in ("part-0.jsonl", "part-1.jsonl.gz"):
        text = json.dumps({"image": "images/a.png", "conversations": turns}) + "\n"
        if name.endswith(".gz"):
            import gzip

            (lines / name).write_bytes(gzip.compress(text.encode()))
        else:
            (lines / name).write_text(text)
    with pytest.raises(readers.KindError, match="files are of several kinds: part-0.jsonl .JSON Lines., "
                       "part-1.jsonl.gz .JSON Lines, gzip."):
        readers.sniff(lines)
    (lines / "part-1.jsonl.gz").unlink()
    (lines / "part-1.jsonl").write_text(json.dumps({"image": "images/a.png", "conversations": turns}) + "\n")
    both = parse_file(lines)
    assert [r.images for r in both.records] == [[str(lines / "images" / "a.png")]] * 2 and not both.problems
    assert shards.shard_count(lines, 0.5) == 1  # the 1 MiB beside the data is not data

    for name in ("train-00000.parquet", "test-00000.parquet"):
        datasets.Dataset.from_list(rows[:2]).to_parquet(str(tmp_path / "both" / name))
    (problem,) = parse_file(tmp_path / "both").problems
    assert problem.reason == "several_splits" and "test: 1 file(s), train: 1 file(s)" in problem.message


def test_a_glob_reads_the_data_files_it_matches_as_one_dataset(tmp_path, tokenizer_dir, monkeypatch):
    """`data/train-*.parquet` (as `datasets` and `hf download --include` take it): the Parquet shards `datasets`
    wrote, in the order of their paths below the glob's fixed directories, are one dataset; a problem names its
    file by that path. `**` reaches any depth; hidden files and files of no data kind are not data; a glob over
    several splits' files, or matching no data file, is one problem; a file whose name holds `[` is itself."""
    import datasets

    from pipeline.data import kinds, shards

    rows = _columnar(RECORDS) + [{"system": None, "id": "empty", "messages": []}]
    data = tmp_path / "data"
    (data / "en").mkdir(parents=True)
    for k, (start, end) in enumerate(((0, 3), (3, 6))):
        datasets.Dataset.from_list(rows[start:end]).to_parquet(str(data / f"train-{k:05d}-of-00003.parquet"))
    datasets.Dataset.from_list(rows[6:]).to_parquet(str(data / "en" / "train-00002-of-00003.parquet"))
    (data / ".train-00009.parquet").write_bytes(b"not data")  # hidden: a tool's temporary file
    (data / "train-notes.md").write_text("# how the shards were cut\n")
    datasets.Dataset.from_list(rows[:2]).to_parquet(str(data / "test-00000-of-00001.parquet"))

    glob = str(data / "**" / "train-*")
    assert [p.relative_to(data).as_posix() for p in kinds.glob_files(glob)] == [
        "en/train-00002-of-00003.parquet", "train-00000-of-00003.parquet", "train-00001-of-00003.parquet"]
    parsed = parse_file(glob)
    assert parsed.layout == "parquet" and [p.reason for p in parsed.problems] == ["empty_turns"]
    assert [r.id for r in parsed.records] == [r["id"] for r in RECORDS[6:] + RECORDS[:6]]
    report = validate_dataset(glob, tokenizer_dir=tokenizer_dir, max_length=128, too_long="error")
    (problem,) = [p for _, p in report.problems]
    assert problem.where() == f"{glob} (Parquet) record 1 (record 1 of en/train-00002-of-00003.parquet, id 'empty')"
    size = sum(p.stat().st_size for p in kinds.glob_files(glob))
    assert shards.shard_count(glob, size / 2**20 / 2.5) == 3  # the matched data files' bytes, not the folder's

    monkeypatch.chdir(tmp_path)  # a relative glob, as a config gives it: files named below data/
    relative = parse_file("data/train-*.parquet")
    assert [r.id for r in relative.records] == [r["id"] for r in RECORDS[:6]] and relative.name == "data/train-*.parquet"

    (problem,) = parse_file(str(data / "*.parquet")).problems
    assert problem.reason == "several_splits" and "test: 1 file(s), train: 2 file(s)" in problem.message
    (problem,) = parse_file(str(data / "valid-*.parquet")).problems
    assert problem.reason == "no_match"
    literal = data / "train[1].jsonl"
    literal.write_text(json.dumps(RECORDS[0]) + "\n")
    assert [r.id for r in parse_file(literal).records] == [RECORDS[0]["id"]]


def test_columns_of_no_shape_are_one_line_without_reading_rows(tmp_path, monkeypatch):
    path = tmp_path / "qa.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": f"q{i}", "answer": "a"} for i in range(50)]), path)
    monkeypatch.setattr(readers, "read_raw", lambda *a: pytest.fail("rows read"))
    (problem,) = parse_file(path).problems
    assert problem.reason == "unknown_shape" and problem.index is None
    assert "the columns are 'question', 'answer'" in problem.message and "data.columns" in problem.message


# --- CSV / TSV, compressed text, and the kinds we do not read -----------------------------------


def _messages_frame(records: list[dict]):
    """A pandas table with the conversation as JSON text in a `messages` cell (how a table keeps a list)."""
    import pandas as pd

    return pd.DataFrame([{"id": r["id"], "messages": json.dumps(r["messages"]), "system": r.get("system")}
                         for r in records])


@pytest.mark.parametrize("kind", ["csv", "tsv"])
def test_a_pandas_table_with_a_json_messages_column_reads_as_its_json_lines_twin(tmp_path, kind):
    path = tmp_path / f"d.{kind}"
    _messages_frame(RECORDS).to_csv(path, sep="," if kind == "csv" else "\t")  # pandas' default: an index column
    parsed = parse_file(path)
    assert parsed.problems == [] and parsed.layout == kind
    reference = parse_file(write_kind(tmp_path, "jsonl"))
    assert [(r.id, r.index, r.messages) for r in parsed.records] == [(r.id, r.index, r.messages)
                                                                     for r in reference.records]
    assert [r.line for r in parsed.records] == list(range(2, 2 + len(RECORDS)))  # the header is line 1


def test_a_csv_of_plain_columns_is_mapped_like_any_dataset(tmp_path):
    import pandas as pd

    path = tmp_path / "qa.csv"
    pd.DataFrame({"prompt": ["2+2?", "say, \"hi\"\nthen stop"], "response": ["4", "hi"]}).to_csv(path, index=False)
    (problem,) = parse_file(path).problems  # one line for the file: its columns make no shape
    assert problem.reason == "unknown_shape" and "'prompt', 'response'" in problem.message
    parsed = parse_file(path, FieldMap({"completion": "response"}))
    assert parsed.problems == []
    assert [m["content"] for m in parsed.records[1].messages] == ["say, \"hi\"\nthen stop", "hi"]  # quoted, 2 lines
    assert [r.line for r in parsed.records] == [2, 3]


def test_a_bad_json_cell_is_a_problem_of_its_record(tmp_path):
    import pandas as pd

    frame = _messages_frame(RECORDS[:3])
    frame.loc[1, "messages"] = '[{"role": "user", "content": "hi"'
    frame.to_csv(tmp_path / "d.csv", index=False)
    (problem,) = parse_file(tmp_path / "d.csv").problems
    assert (problem.reason, problem.index, problem.line, problem.field) == ("invalid_json", 1, 3, "messages")
    assert problem.describe().startswith(f"{tmp_path / 'd.csv'} (CSV) record 1 (line 3")


@pytest.mark.parametrize("codec", ["gz", "zst", "bz2", "xz"])
def test_compressed_json_lines_and_arrays_read_as_the_plain_file(tmp_path, codec):
    import bz2
    import gzip
    import lzma

    import zstandard

    compress = {"gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress,
                "zst": zstandard.ZstdCompressor().compress}[codec]
    for kind in ("jsonl", "json"):
        plain = write_kind(tmp_path, kind)
        packed = tmp_path / f"{plain.name}.{codec}"
        packed.write_bytes(compress(plain.read_bytes()))
        parsed = parse_file(packed)
        assert parsed.problems == [] and parsed.layout == f"{kind}.{codec}"
        assert [r.messages for r in parsed.records] == [r.messages for r in parse_file(plain).records]
        assert readers.describe_kind(parsed.layout).startswith("JSON")


def test_a_compressed_file_named_otherwise_is_named_as_what_it_is(tmp_path):
    import gzip

    plain = write_kind(tmp_path, "jsonl")
    (tmp_path / "x.jsonl").write_bytes(gzip.compress(plain.read_bytes()))  # gzip without .gz
    (problem,) = parse_file(tmp_path / "x.jsonl").problems
    assert problem.reason == "wrong_kind" and "gzip-compressed" in problem.message and "x.jsonl.gz" in problem.message
    (tmp_path / "y.jsonl.zst").write_bytes(plain.read_bytes())  # named .zst, not compressed
    (problem,) = parse_file(tmp_path / "y.jsonl.zst").problems
    assert problem.reason == "not_zst" and "not compressed" in problem.message


def test_a_truncated_gzip_is_one_problem_after_the_records_it_held(tmp_path):
    import gzip

    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(gzip.compress(write_kind(tmp_path, "jsonl", [_record(i) for i in range(200)]).read_bytes())[:-30])
    parsed = parse_file(path)
    (problem,) = parsed.problems
    assert problem.reason == "invalid_gz" and "to its end" in problem.message and len(parsed.records) > 100


@pytest.mark.parametrize("name", ["d.xlsx", "d.txt"])
def test_another_kind_is_one_line_naming_it_and_the_kinds_accepted(tmp_path, name):
    """A spreadsheet and a text file: one problem for the file (never one per line), naming what it is."""
    path = tmp_path / name
    if name.endswith(".xlsx"):
        _messages_frame(RECORDS).to_excel(path)  # pandas + openpyxl: a real workbook
    else:
        path.write_text("".join(f"repeat: w{i} -> w{i}\n" for i in range(50)))
    (problem,) = parse_file(path).problems
    assert problem.reason == "unsupported_kind" and problem.file == str(path) and problem.index is None
    what = "Excel workbook (.xlsx)" if name.endswith(".xlsx") else "plain text (.txt)"
    assert what in problem.message and "accepted: JSON (.json), JSON Lines" in problem.message
    assert "CSV (.csv)" in problem.message and ".zst" in problem.message
    assert "\n" not in problem.describe()
