"""A training dataset given by hub URL, read through the pin `fetch-data` writes (pipeline/storage/hub_data.py):
validation's record problems (its scan's and the merged verdicts') name the dataset by its URL, the record numbered
across its shards; its images are read beside its files in the cache."""

from __future__ import annotations

import json

from huggingface_hub import constants
from kits.hub import add_to_cache, write_parquet_shards

from pipeline.data import validate as v
from pipeline.storage import hub_data


def test_validation_names_a_hub_record_by_the_url_and_its_place_across_the_shards(tmp_path, tokenizer_dir,
                                                                                 monkeypatch):
    records = [{"prompt": f"q{i}?", "completion": "x" * (200 if i == 5 else 3)} for i in range(7)] + [
        {"prompt": "q0?", "completion": "xxx"}]  # record 7 repeats record 0
    repo = tmp_path / "repo"
    write_parquet_shards(repo, records, 2)  # records 5 and 7 are the second shard's 1 and 3
    cache = tmp_path / "hf-cache"
    add_to_cache(cache, "org/long", repo, repo_type="dataset")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    url, pin = "hf://datasets/org/long/data/train-*.parquet", tmp_path / "train.hub.json"
    assert hub_data.main(["--url", url, "--out", str(pin)]) == 0

    report = v.validate_dataset(pin, tokenizer_dir=tokenizer_dir, max_length=64, too_long="error")
    found = [(p.file, p.index, p.part, p.part_index, p.reason) for _, p in report.problems]
    assert found == [(url, 5, "data/train-00001.parquet", 1, "too_long"),
                     (url, 7, "data/train-00001.parquet", 3, "duplicate_sample")]
    assert report.problems[0][1].where() == f"{url} (Parquet) record 5 (record 1 of data/train-00001.parquet)"
    assert json.loads(pin.read_text())["url"] == url


def test_a_bad_line_of_a_hub_dataset_of_several_json_lines_files_names_its_file_with_or_without_shard_jobs(
        tmp_path, tokenizer_dir, monkeypatch):
    """Three JSON Lines files under one URL, records numbered across them; a line that is no JSON in the third and
    a record without turns in the second are named by their own file and line there, the same when the file is
    scanned whole and when two `validate-shard` jobs scan it; the CSV report has the file in its own column. A
    file-level fault (an empty file) names the file by its path in the repo."""
    import pandas as pd

    from pipeline.data import scan, shards

    good = [json.dumps({"prompt": f"q{i}?", "completion": "a"}) for i in range(6)]
    repo = tmp_path / "repo"
    (repo / "data" / "en").mkdir(parents=True)
    (repo / "data" / "a.jsonl").write_text("\n".join(good[:2]) + "\n")
    (repo / "data" / "en" / "b.jsonl").write_text("\n".join([good[2], json.dumps({"text2": "x"})]) + "\n")
    (repo / "data" / "en" / "c.jsonl").write_text("\n".join([good[3], "", "{oops", good[4]]) + "\n")
    (repo / "data" / "z.jsonl").write_text("")
    cache = tmp_path / "hf-cache"
    add_to_cache(cache, "org/lines", repo, repo_type="dataset")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    url, pin = "hf://datasets/org/lines/data/*.jsonl", tmp_path / "train.hub.json"  # * matches across folders
    assert hub_data.main(["--url", url, "--out", str(pin)]) == 0

    whole = v.validate_dataset(pin, tokenizer_dir=tokenizer_dir, max_length=64, too_long="error")
    monkeypatch.setattr(shards, "BLOCK", 2)  # records 0-1, 4-5 to shard 0; 2-3, 6 to shard 1
    scans = []
    for k in range(2):
        out = tmp_path / f"scan{k}.json"
        assert scan.main(["--train", str(pin), "--shard", f"{k}/2", "--tokenizer", str(tokenizer_dir), "--max-length",
                          "64", "--too-long", "error", "--reasoning", "auto", "--out", str(out)]) == 0
        scans.append(out)
    sharded = v.validate_dataset(pin, tokenizer_dir=tokenizer_dir, max_length=64, too_long="error",
                                 train_scans=scans)
    for report in (whole, sharded):
        by_reason = {p.reason: p for _, p in report.problems}
        assert by_reason["invalid_json"].where() == (f"{url} (JSON Lines) record 5 (record 1 of data/en/c.jsonl, "
                                                      "line 3)")
        assert (by_reason["missing_turns"].part, by_reason["missing_turns"].part_index,
                by_reason["missing_turns"].line) == ("data/en/b.jsonl", 1, 2)
        assert by_reason["empty_file"].message.startswith("data/z.jsonl: ")
    assert [p.describe() for _, p in whole.problems] == [p.describe() for _, p in sharded.problems]

    v.write_report(whole, tmp_path / "validation.json", tmp_path / "validation.csv")
    rows = pd.read_csv(tmp_path / "validation.csv").set_index("reason")
    assert (rows.loc["invalid_json", "part"], rows.loc["invalid_json", "part_index"],
            rows.loc["invalid_json", "line"]) == ("data/en/c.jsonl", 1, 3)


def test_an_image_beside_a_hub_dataset_that_was_not_fetched_says_how_to_fetch_it(tmp_path, monkeypatch):
    """Records of a hub dataset name images in the repo (images/0.png beside train.jsonl), and only the data file
    the URL matches is in the cache: the missing image's problem names the repo, the commit and the `hf download`
    that fetches the images' folder. A missing image elsewhere is the plain message."""
    from pipeline.data.formats import load_records
    from pipeline.data.images import check_image

    repo = tmp_path / "repo"
    repo.mkdir()
    turns = [{"from": "human", "value": "<image>\nwhat colour?"}, {"from": "gpt", "value": "red"}]
    (repo / "train.jsonl").write_text(json.dumps({"id": "a", "image": "images/0.png", "conversations": turns}) + "\n")
    cache = tmp_path / "hf-cache"
    snapshot = add_to_cache(cache, "org/pictures", repo, repo_type="dataset")  # the data file only, no images/
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    pin = tmp_path / "train.hub.json"
    assert hub_data.main(["--url", "hf://datasets/org/pictures/train.jsonl", "--out", str(pin)]) == 0
    (record,) = load_records(pin)
    assert record.images == [str(snapshot / "images" / "0.png")]
    reason, message = check_image(record.images[0])
    assert reason == "image_missing" and message.startswith(f"image file not found: {snapshot / 'images' / '0.png'} (")
    assert (f"`hf download org/pictures --repo-type dataset --revision {snapshot.name} --include 'images/*'`"
            in message)
    absent = tmp_path / "absent.png"
    assert check_image(str(absent)) == ("image_missing", f"image file not found: {absent}")
