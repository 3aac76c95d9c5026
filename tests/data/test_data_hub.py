"""A training dataset given by hub URL, read through the pin `fetch-data` writes (pipeline/storage/hub_data.py):
validation's record problems (its scan's and the merged verdicts') name the dataset by its URL, the record numbered
across its shards; its images are read beside its files in the cache."""

from __future__ import annotations

import json

import pytest
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
    assert check_image(str(absent)) == ("image_missing", f"image file not found: {absent} (the data's relative image "
                                        "paths start from the dataset file's directory, or from data.image_dir "
                                        "where it is set)")


def test_fetch_data_online_fetches_the_images_the_records_name_from_the_pinned_commit(tmp_path, monkeypatch,
                                                                                      capsys):
    """A hub repo keeps train.jsonl (its image key `img`, mapped with --columns) beside images/; the URL matches the
    data file. Online, `fetch-data` pins it, reads the records and downloads from the same commit the images they
    name, by name, and no other file of the repo; an image the repo lacks stays missing, and validation names it.
    Offline, nothing more is asked of the hub. (huggingface_hub's `snapshot_download` is played by a stand-in that
    copies the files the patterns match, as `hf download --include` matches them, from the repo to the cache.)"""
    import shutil

    from huggingface_hub.utils import filter_repo_objects
    from PIL import Image

    from pipeline.data import hub_images
    from pipeline.data.formats import parse_file
    from pipeline.data.images import check_image
    from pipeline.data.shapes import field_map

    remote = tmp_path / "remote"
    (remote / "images").mkdir(parents=True)
    for name in ("0.png", "1 [b].png", "unused.png"):
        Image.new("RGB", (32, 32), "red").save(remote / "images" / name)
    turns = [{"from": "human", "value": "<image>\nwhat colour?"}, {"from": "gpt", "value": "red"}]
    records = [{"img": f"images/{name}", "conversations": turns} for name in ("0.png", "1 [b].png", "gone.png")]
    (remote / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cache, commit = tmp_path / "hf-cache", "c" * 40
    asked: list[list[str]] = []  # the patterns of each call

    def snapshot_download(repo_id, *, repo_type, revision, cache_dir=None, allow_patterns=None,
                          local_files_only=False):
        assert (repo_id, repo_type, revision) in {("org/pictures", "dataset", None), ("org/pictures", "dataset",
                                                                                      commit)}
        asked.append(allow_patterns)
        if local_files_only:  # a look-up in the cache
            return str(cache / "datasets--org--pictures" / "snapshots" / commit)
        names = sorted(p.relative_to(remote).as_posix() for p in remote.rglob("*") if p.is_file())
        chosen = tmp_path / f"chosen{len(asked)}"
        for name in filter_repo_objects(names, allow_patterns=allow_patterns):
            (chosen / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(remote / name, chosen / name)
        return str(add_to_cache(cache, repo_id, chosen, repo_type="dataset", commit=commit))

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    url, pin = "hf://datasets/org/pictures/train.jsonl", tmp_path / "train.hub.json"
    assert hub_images.main(["--url", url, "--out", str(pin), "--columns", "image=img"]) == 0
    assert asked == [["train.jsonl"], ["images/0.png", "images/1 [[]b].png", "images/gone.png"]]
    downloads = len(asked)
    snapshot = cache / "datasets--org--pictures" / "snapshots" / commit
    assert sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()) == [
        "images/0.png", "images/1 [b].png", "train.jsonl"]
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"{url}: 2 of 3 image file(s) its records name fetched beside the data; 1 not in the repo at that commit "
        "(validation names each)")
    parsed = parse_file(pin, field_map("image=img"))
    assert [check_image(r.images[0]) is None for r in parsed.records] == [True, True, False]
    assert check_image(parsed.records[2].images[0])[0] == "image_missing"

    # Offline: the pin from the cache (one look-up there), and no download asked for.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    (snapshot / "images" / "0.png").unlink()
    assert hub_images.main(["--url", url, "--out", str(pin), "--columns", "image=img"]) == 0
    assert asked[downloads:] == [["train.jsonl"]] and not (snapshot / "images" / "0.png").exists()


def test_missing_images_are_asked_for_by_name_or_by_their_folder_when_it_misses_many():
    from pipeline.data import hub_images

    many = [f"frames/{k:03d}.jpg" for k in range(hub_images.MAX_LISTED + 1)]
    assert hub_images.patterns(["a.png", "img/x*.png", *many]) == ["a.png", "frames/*", "img/x[*].png"]
    assert hub_images.patterns(many[:hub_images.MAX_LISTED]) == many[:hub_images.MAX_LISTED]


def test_a_table_is_read_for_image_files_only_where_its_image_column_holds_paths(tmp_path, monkeypatch):
    """A Parquet dataset whose `image` column holds paths names files beside it; one `datasets` wrote with an Image
    column brings its images inside, and fetch-data does not read its rows (every image would be decoded and
    written where Snakemake runs). Where data.image_dir is set, the images are not the repo's to fetch."""
    import datasets
    from PIL import Image

    from pipeline.data import hub_images
    from pipeline.data.formats import load_records

    turns = [{"from": "human", "value": "<image>\nwhat colour?"}, {"from": "gpt", "value": "red"}]
    repo = tmp_path / "repo"
    repo.mkdir()
    datasets.Dataset.from_list([{"image": "images/0.png", "conversations": turns}]).to_parquet(str(repo / "p.parquet"))
    picture = tmp_path / "red.png"
    Image.new("RGB", (32, 32), "red").save(picture)
    embedded = datasets.Dataset.from_list([{"image": str(picture), "conversations": turns}]).cast_column(
        "image", datasets.Image())
    embedded.to_parquet(str(repo / "e.parquet"))
    cache = tmp_path / "hf-cache"
    add_to_cache(cache, "org/tables", repo, repo_type="dataset")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    pins = {}
    for name in ("p", "e"):
        pins[name] = tmp_path / f"{name}.hub.json"
        assert hub_data.main(["--url", f"hf://datasets/org/tables/{name}.parquet", "--out", str(pins[name])]) == 0
    fields = hub_images.FieldMap()
    assert hub_images.missing_images(pins["p"], fields) == ["images/0.png"]
    # the images kept elsewhere (data.image_dir): nothing to fetch, and the records name them there
    elsewhere = hub_images.FieldMap(image_dir=str(tmp_path / "mine"))
    assert hub_images.missing_images(pins["p"], elsewhere) == []
    assert load_records(pins["p"], elsewhere)[0].images == [str(tmp_path / "mine" / "images" / "0.png")]
    monkeypatch.setattr(hub_images, "stream_file", lambda *a, **k: pytest.fail("rows read"))
    assert not hub_images.may_name_files(pins["e"], fields) and hub_images.missing_images(pins["e"], fields) == []
