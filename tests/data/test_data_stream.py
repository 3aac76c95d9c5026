"""Streaming: files are read record by record, validated and tokenized batch by batch, the cache written
incrementally -- with the results of reading everything at once.

How the batches fall must not change any result: the reports and caches made
with a batch of 3 records equal those made with one batch for the whole file,
on data whose duplicates, repeated ids and split overlaps straddle batches.
(That peak memory does not grow with the record count is measured by
bench/bench_data.py at 100k and 1M records: too slow for a unit test.)
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from pipeline.data import parts, scan, shards, tokenize as tk, tokenize_cli, validate as v
from pipeline.errors import DataError
from pipeline.data.cache import FORMAT, CacheWriter, TokenCache, _image_tensors, write_cache
from pipeline.data.formats import duplicate_of, load_records, stream_file
from pipeline.data.stream import DigestIndex, sample_digest

from test_data_files import KINDS, RECORDS, write_kind


def sample(i: int, answer: str | None = None, **extra) -> dict:
    return {"id": f"r{i}", "conversations": [
        {"from": "human", "value": f"repeat: w{i}"}, {"from": "gpt", "value": answer or f"w{i}"}], **extra}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# --- reading ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "json"])
def test_records_stream_one_at_a_time_from_every_kind_but_a_json_array(tmp_path, kind):
    """The first record comes after one record is read (not the file); then the same records as JSON Lines."""
    parsed, records = stream_file(write_kind(tmp_path, kind))
    first = next(records)
    assert parsed.records_seen == 1 and parsed.layout == kind.split("-")[0]
    rest = list(records)
    reference = load_records(write_kind(tmp_path, "jsonl"))
    assert [(r.id, r.index, r.line is None, r.messages) for r in [first, *rest]] == [
        (r.id, r.index, kind != "jsonl", r.messages) for r in reference]
    assert parsed.records_seen == len(RECORDS) and parsed.problems == []


def test_a_fault_late_in_a_file_is_found_after_the_records_before_it_streamed(tmp_path):
    records = [sample(i) for i in range(5)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "{not json\n" + json.dumps(sample(9)) + "\n")
    parsed, stream = stream_file(path)
    assert next(stream).index == 0 and parsed.problems == []  # nothing read beyond the first line yet
    assert [r.index for r in stream] == [1, 2, 3, 4, 6]
    (problem,) = parsed.problems
    assert (problem.reason, problem.index, problem.line, problem.kind) == ("invalid_json", 5, 6, "jsonl")


def test_a_corrupt_parquet_file_streams_its_readable_rows_then_names_the_fault(tmp_path):
    path = write_kind(tmp_path, "parquet", [sample(i) for i in range(9)])  # row groups of 3
    data = path.read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2] + data[-8:])  # the footer survives, a group not
    parsed, stream = stream_file(tmp_path / "cut.parquet")
    got = list(stream)
    assert [p.reason for p in parsed.problems] == ["invalid_parquet"]
    assert parsed.records_seen == len(got) < 9


# --- first occurrences by digest ----------------------------------------------------------------


def test_digest_index_finds_the_first_occurrence_within_and_across_calls():
    index = DigestIndex()
    keys = [bytes([k]) * 16 for k in (1, 2, 1, 3, 2, 1)]
    assert index.first(keys[:3], [10, 11, 12]) == [None, None, 10]
    assert index.first(keys[3:], [13, 14, 15]) == [None, 11, 10]
    assert index.first([bytes([3]) * 16, bytes([4]) * 16], [0, 0], add=False) == [13, None]
    assert len(index) == 3  # first occurrences only; the lookup added nothing
    many = [i.to_bytes(16, "big") for i in range(5000)]
    for start in range(0, 5000, 7):  # runs of uneven sizes, merged as they grow
        assert index.first(many[start:start + 7], list(range(start, start + 7))) == [None] * len(many[start:start + 7])
    assert index.first(many[::-1], [0] * 5000, add=False) == list(range(5000))[::-1]


def test_sample_digests_find_the_duplicates_formats_finds(tmp_path):
    raw = [sample(i % 4) for i in range(9)]
    raw[5]["image"] = "a.png"  # the text of record 1, with an image: no duplicate
    raw[5]["conversations"][0]["value"] = "<image> repeat: w1"
    raw[6]["conversations"][1]["value"] = "w2 "  # differs by a space: no exact duplicate
    records = load_records(write_jsonl(tmp_path / "d.jsonl", [dict(r, id=f"x{i}") for i, r in enumerate(raw)]))
    index = DigestIndex()
    earlier = index.first([sample_digest(r) for r in records], [r.index for r in records])
    assert {i: e for i, e in enumerate(earlier) if e is not None} == duplicate_of(records)


# --- how the batches fall changes nothing --------------------------------------------------------


def _tricky_splits(tmp_path: Path) -> dict[str, Path]:
    """Duplicates, repeated ids, overlaps and over-long records, spread so that batches of 3 split them; a
    placeholder and a stop token trained (the demo template's <|end|>) and a turn marker in a prompt, each
    warned about."""
    train = [sample(i) for i in range(10)]
    train[5], train[8] = sample(5, answer="I am {{name}}."), sample(8, answer="w8<|end|>w8")
    train[6]["conversations"][0]["value"] += "<|end|>"
    train += [sample(1), dict(sample(2), id="t-dup"), sample(11, answer="x" * 300), sample(12, id="r4")]
    val = [sample(20), sample(3, id="v3"), sample(21), sample(22), dict(sample(7), id="v7"), sample(20)]
    test = [sample(30), sample(3, id="t3"), sample(21, id="t21"), sample(31)]
    return {"train": write_jsonl(tmp_path / "train.jsonl", train), "val": write_jsonl(tmp_path / "val.jsonl", val),
            "test": write_jsonl(tmp_path / "test.jsonl", test)}


@pytest.mark.parametrize("duplicates,too_long", [("error", "error"), ("warn", "truncate"), ("drop", "drop")])
def test_validation_reports_the_same_whatever_the_batch_size(tmp_path, tokenizer_dir, monkeypatch, duplicates,
                                                             too_long):
    splits = _tricky_splits(tmp_path)

    def report(batch: int) -> dict:
        monkeypatch.setattr(scan, "SCAN_BATCH", batch)
        return v.validate_dataset(splits["train"], val=splits["val"], test=splits["test"],
                                  tokenizer_dir=tokenizer_dir, max_length=128, too_long=too_long,
                                  duplicates=duplicates).to_json()

    whole = report(10_000)
    assert report(3) == whole
    reasons = {p["reason"] for p in whole["problems"]}
    assert {"duplicate_id", "split_overlap"} <= reasons  # the data exercises what batches could split
    assert whole["files"]["val"]["overlaps"] == {"train": 2} and whole["files"]["test"]["overlaps"] == {
        "train": 1, "val": 1}


# --- how the shards fall changes nothing: N shard jobs + a merge == one job -------------------------


def _run(main, argv: list) -> str | None:
    """`main(argv)` in process; the text of the `DataError` it raised (a failed validation still writes its
    reports), None when it passed."""
    try:
        main([str(a) for a in argv])
    except DataError as err:
        return str(err)
    return None


def _data_jobs(splits: dict, tokenizer_dir: Path, out: Path, n: int, duplicates: str, too_long: str) -> dict:
    """Validate and tokenize `splits` as the workflow's jobs do: one job each (n=1), or n shard jobs of train
    and the merges; the outputs' bytes, and the errors raised."""
    common = ["--tokenizer", tokenizer_dir, "--max-length", 128, "--too-long", too_long, "--reasoning", "auto"]
    train = ["--train", splits["train"]]
    reports = ["--out-json", out / "validation.json", "--out-csv", out / "validation.csv", "--out-drop", out / "drop.npy"]
    held_out = ["--val", splits["val"], "--test", splits["test"], "--duplicates", duplicates]
    tokenize = [*train, *common, "--duplicates", duplicates, "--drop", out / "drop.npy",
                "--out-train", out / "train.safetensors", "--out-stats", out / "stats.json"]
    if n == 1:
        errors = [_run(v.main, [*train, *held_out, *common, *reports]), _run(tokenize_cli.main, tokenize)]
    else:
        scans = [out / f"scan{k}.json" for k in range(n)]
        for k in reversed(range(n)):  # any order
            assert _run(scan.main, [*train, *common, "--shard", f"{k}/{n}", "--out", scans[k]]) is None
        errors = [_run(v.main, [*train, *held_out, *common, *reports, "--scans", *scans])]
        cache_parts = [out / f"part{k}.safetensors" for k in range(n)]
        for k in range(n):
            errors.append(_run(parts.main, [*train, *common, "--duplicates", duplicates, "--drop", out / "drop.npy",
                                            "--shard", f"{k}/{n}", "--out", cache_parts[k]]))
        if errors[-1] is None:
            errors.append(_run(tokenize_cli.main, [*tokenize, "--parts", *cache_parts, "--shards-out", out / "shards.json"]))
    outputs = {name: (out / name).read_bytes() for name in
               ("validation.json", "validation.csv", "drop.npy", "train.safetensors", "stats.json")
               if (out / name).exists()}
    return {"outputs": outputs, "errors": [e for e in errors if e is not None]}


@pytest.mark.parametrize("duplicates,too_long", [("error", "error"), ("warn", "truncate"), ("drop", "drop")])
def test_four_shards_give_the_reports_and_the_cache_of_one_job(tmp_path, tokenizer_dir, monkeypatch, duplicates,
                                                               too_long):
    """Byte for byte: validation.json / .csv, the drop list, the token cache and stats.json, on data with a
    duplicate whose copies lie in two shards, an id repeated across shards and val / test records in train."""
    monkeypatch.setattr(shards, "BLOCK", 3)  # 14 train records: blocks of 3 over 4 shards, each owning some
    splits = _tricky_splits(tmp_path)
    one = _data_jobs(splits, tokenizer_dir, tmp_path / "out", 1, duplicates, too_long)
    (tmp_path / "one").mkdir()
    for path in (tmp_path / "out").iterdir():  # the same output paths (stats.json names the cache's)
        path.rename(tmp_path / "one" / path.name)
    four = _data_jobs(splits, tokenizer_dir, tmp_path / "out", 4, duplicates, too_long)
    assert four["outputs"] == one["outputs"] and four["errors"] == one["errors"]
    report = json.loads(one["outputs"]["validation.json"])
    owner = lambda index: int(shards.owner(index, 4))
    copies = [p for p in report["problems"] + report["warnings"] if p["reason"] == "duplicate_sample"]
    if duplicates != "drop":  # drop: they are neither problems nor warnings, only left out (below)
        assert copies and all(owner(p["index"]) != owner(int(p["message"].rsplit(" ", 1)[1])) for p in copies)
    assert {"duplicate_id", "split_overlap"} <= {p["reason"] for p in report["problems"]}
    named = {w["reason"]: w["message"].rpartition(", holding ")[2] for w in report["warnings"]}
    assert named["placeholders_trained"] == "'{{name}}')" and named["stop_tokens_inside"] == "'<|end|>')"
    assert named["markers_in_prompts"] == "'<|end|>')"  # each found by one of the 4 shards, named as one job names it
    assert (owner(5), owner(8)) == (1, 2)  # found by two shards, merged as one job finds them
    if duplicates == "drop":
        assert np.load(tmp_path / "one" / "drop.npy").tolist() == [10, 11]  # copies of 1 and 2: shards 3 and 0
        assert (owner(10), owner(1)) == (3, 0)
        stats = json.loads(one["outputs"]["stats.json"])["splits"]["train"]
        assert (stats["duplicates_dropped"], stats["records"]) == (2, 11)  # and the over-long record dropped
    if too_long != "error":  # else tokenization stops at the over-long record, in both
        timed = json.loads((tmp_path / "out" / "shards.json").read_text())["shards"]
        assert [s["shard"] for s in timed] == [0, 1, 2, 3] and all(s["seconds"] >= 0 for s in timed)


def test_a_shard_scanned_before_the_later_chat_flags_loads_with_them_unset(tmp_path):
    """A shard's facts saved by a version that kept 4 chat flags (before `placeholders_trained`,
    `stop_tokens_inside` and `markers_in_prompts`), merged by this one: the flags it did not check read as
    not found."""
    flags = np.array([[True, False, True, False], [False, True, False, True]])
    scan.SplitFacts("train", "train.jsonl", "jsonl", arrays={"index": np.arange(2), "flags": flags}).save(
        tmp_path / "shard.json")
    loaded = scan.SplitFacts.load(tmp_path / "shard.json").arrays["flags"]
    assert loaded.shape == (2, scan.CHAT_FLAG_COUNT) == (2, len(tk.CHAT_COUNTS))
    assert np.array_equal(loaded[:, :4], flags) and not loaded[:, 4:].any()

def test_tokenization_parts_counted_before_the_later_chat_flags_merge_with_them_at_zero(tmp_path, tokenizer):
    """A tokenization part's counters written by a version without `placeholders_trained`,
    `stop_tokens_inside` and `markers_in_prompts` still make the split's stats."""
    source = write_jsonl(tmp_path / "train.jsonl", [sample(i) for i in range(3)])
    class Sink:  # the cache writer's place: only the counters matter here
        def append(self, *arrays):
            pass
    encoder = tk.SplitEncoder(tokenizer, Sink(), max_length=64, too_long="error", source=str(source))
    encoder.add(load_records(source))
    old = {k: v for k, v in encoder.counters().items() if k not in tk.FOUND}
    stats = tk.split_stats(old, np.concatenate(encoder.kept_lengths), source=str(source), max_length=64)
    assert stats == encoder.finish()  # the 3 records have neither

@pytest.mark.parametrize("duplicates", ["error", "drop"])
def test_tokenization_caches_the_same_bytes_whatever_the_batch_size(tmp_path, tokenizer, monkeypatch, duplicates):
    records = [sample(i % 7, answer=("y" * (i % 7 * 13)) or None) for i in range(20)]  # 7 distinct, some truncated
    source = write_jsonl(tmp_path / "train.jsonl", [dict(r, id=f"x{i}") for i, r in enumerate(records)])

    def cache(batch: int, name: str) -> tuple[bytes, dict]:
        monkeypatch.setattr(tk, "BATCH_SIZE", batch)
        stats = tk.tokenize_file(source, tokenizer, out_path=tmp_path / name, max_length=64, too_long="truncate",
                                 fingerprint="f", split="train", duplicates=duplicates)
        return (tmp_path / name).read_bytes(), stats

    whole, stats = cache(10_000, "whole.safetensors")
    assert cache(3, "small.safetensors") == (whole, stats)
    assert stats["duplicates_dropped"] == (13 if duplicates == "drop" else 0)
    # ... and the arrays are those of encoding the file's records in memory.
    kept = load_records(source)[: 7 if duplicates == "drop" else None]
    enc = tk.encode_records(kept, tokenizer, max_length=64, too_long="truncate", source=str(source))
    got = TokenCache(tmp_path / "whole.safetensors")
    assert np.array_equal(got._input_ids, enc.input_ids) and np.array_equal(got._labels, enc.labels)
    assert np.array_equal(got._offsets, enc.offsets)
    assert list(tmp_path.glob(".*")) == []  # no spool file left behind


def test_a_file_with_problems_writes_no_cache_and_lists_them_all(tmp_path, tokenizer):
    records = [sample(i) for i in range(7)]
    records[1]["conversations"][1]["value"] = ""
    records[6]["conversations"] = []
    source = write_jsonl(tmp_path / "train.jsonl", records)
    with pytest.raises(Exception, match=r"not a valid dataset: 2 problem\(s\)") as err:
        tk.tokenize_file(source, tokenizer, out_path=tmp_path / "c.safetensors", max_length=64, too_long="error",
                         fingerprint="f", split="train")
    assert "record 1" in str(err.value) and "record 6" in str(err.value)
    assert list(tmp_path.iterdir()) == [source]  # neither a cache nor a spool


# --- the cache writer --------------------------------------------------------------------------


def _header(path: Path) -> tuple[int, dict, bytes]:
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    return size, json.loads(data[8:8 + size]), data[8 + size:]


@pytest.mark.parametrize("images", [None, [["a.png"], [], ["b\u00e9.png", "c.png"]]])
def test_the_cache_writer_writes_what_safetensors_writes(tmp_path, images):
    """Same header (safetensors orders metadata at random: compared parsed), same bytes after it."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, 11).astype(np.int32)
    labels = np.where(rng.random(11) < 0.5, ids, -100).astype(np.int32)
    lengths = np.array([4, 0, 7])
    meta = {"split": "train", "source": "/data/\u00e9 x.jsonl"}
    with CacheWriter(tmp_path / "w.safetensors") as writer:
        for a, b in ((0, 1), (1, 3)):  # two appends
            lo, hi = lengths[:a].sum(), lengths[:b].sum()
            writer.append(ids[lo:hi], labels[lo:hi], lengths[a:b], images[a:b] if images else None)
        writer.close(meta)
    tensors = {"input_ids": ids, "labels": labels, "offsets": np.array([0, 4, 4, 11], dtype=np.int64)}
    if images:
        tensors.update(_image_tensors(images))
    save_file(tensors, str(tmp_path / "r.safetensors"), metadata={"format": FORMAT, **meta})
    assert _header(tmp_path / "w.safetensors") == _header(tmp_path / "r.safetensors")
    cache = TokenCache(tmp_path / "w.safetensors")
    assert cache[2][0].tolist() == ids[4:].tolist() and cache.images(2) == (images[2] if images else [])
    write_cache(tmp_path / "x.safetensors", input_ids=ids, labels=labels, offsets=tensors["offsets"], metadata=meta,
                images=images)
    assert (tmp_path / "x.safetensors").read_bytes() == (tmp_path / "w.safetensors").read_bytes()


def test_a_cache_writer_left_unclosed_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with CacheWriter(tmp_path / "c.safetensors") as writer:
            writer.append(np.arange(3), np.arange(3), [3])
            raise RuntimeError("tokenization failed")
    assert list(tmp_path.iterdir()) == []


def test_supervised_counts_are_read_from_the_arrays_as_a_loop_over_records_counts_them(tmp_path, monkeypatch):
    """`TokenCache.supervised_counts` (what a training stage counts at its start) equals the per-record loop it
    replaced, with empty and one-token records, records longer than a slice, and slices that end mid-record."""
    from pipeline.data import cache as cache_module
    from pipeline.data.mix import ConcatCache

    rng = np.random.default_rng(1)
    lengths = np.array([0, 1, 5, 40, 0, 3, 17, 1, 64, 2])
    ids = rng.integers(0, 100, lengths.sum()).astype(np.int32)
    labels = np.where(rng.random(lengths.sum()) < 0.6, ids, -100).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    write_cache(tmp_path / "c.safetensors", input_ids=ids, labels=labels, offsets=offsets, metadata={})
    cache = TokenCache(tmp_path / "c.safetensors")
    loop = [int((cache[i][1][1:] != -100).sum()) for i in range(len(cache))]
    assert cache.supervised_counts().tolist() == loop and sum(loop) > 0
    monkeypatch.setattr(cache_module, "_COUNT_TOKENS", 7)  # slices of 7 tokens: most records span several
    assert cache.supervised_counts().tolist() == loop
    assert ConcatCache([cache, cache]).supervised_counts().tolist() == loop + loop
