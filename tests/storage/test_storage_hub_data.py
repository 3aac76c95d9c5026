"""Dataset files given by hub URL (pipeline/storage/hub_data.py), without the network: a dataset-repo cache
laid out as `hf download --repo-type dataset` leaves it (tests/kits/hub.py), the pin `fetch-data` writes, and
the pin read as one dataset by every reader (pipeline/data/readers.py): its shards in sorted order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from huggingface_hub import constants
from kits.hub import add_to_cache, write_parquet_shards

from pipeline.data import readers
from pipeline.data.formats import load_records, parse_file
from pipeline.data.shards import shard_count
from pipeline.errors import DataError, UserError
from pipeline.storage import hub_data
from pipeline.workflow_config import default_name, path_problems

REPO_ID = "org/chat-data"
RECORDS = [{"prompt": f"question {i}?", "completion": f"answer {i}."} for i in range(7)]


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def cache(tmp_path) -> tuple[Path, Path]:
    """(the cache, the snapshot): RECORDS as two Parquet shards under data/, a README beside them."""
    repo = tmp_path / "repo"
    write_parquet_shards(repo, RECORDS, 2)
    (repo / "README.md").write_text("# chat data\n")
    cache = tmp_path / "hf-cache"
    return cache, add_to_cache(cache, REPO_ID, repo, repo_type="dataset")


@pytest.mark.parametrize("url, repo_id, revision, pattern", [
    ("hf://datasets/HuggingFaceH4/no_robots/data/train-*.parquet", "HuggingFaceH4/no_robots", None,
     "data/train-*.parquet"),
    ("hf://datasets/org/name@v1.0/train.jsonl", "org/name", "v1.0", "train.jsonl"),
    # the whole repo: the split each key asks for (pipeline/data/hub_splits.py)
    ("hf://datasets/HuggingFaceH4/no_robots", "HuggingFaceH4/no_robots", None, None),
    ("hf://datasets/teknium/OpenHermes-2.5@main/", "teknium/OpenHermes-2.5", "main", None),
    ("hf://datasets/org/name@refs%2Fconvert%2Fparquet/default/train/0000.parquet", "org/name",
     "refs/convert/parquet", "default/train/0000.parquet"),
    # a file's address as a browser shows it: its page, its download link; one file (its name's [ is no glob)
    ("https://huggingface.co/datasets/HuggingFaceH4/ultrachat_200k/blob/main/data/train_sft-00000-of-00003.parquet",
     "HuggingFaceH4/ultrachat_200k", "main", "data/train_sft-00000-of-00003.parquet"),
    ("https://huggingface.co/datasets/org/name/resolve/refs%2Fconvert%2Fparquet/default/train/0000.parquet"
     "?download=true", "org/name", "refs/convert/parquet", "default/train/0000.parquet"),
    ("https://hf.co/datasets/org/name/blob/v1.0/chats/my%20set%20%5B2%5D.jsonl", "org/name", "v1.0",
     "chats/my set [[]2].jsonl"),
])
def test_a_hub_url_names_the_repo_revision_and_files(url, repo_id, revision, pattern):
    assert hub_data.parse(url) == hub_data.HubFiles(url, repo_id, revision, pattern)


@pytest.mark.parametrize("url, repo_id, subset, split, name", [
    # a dataset's page, its viewer, a subset's or one split's in the viewer, as the browser shows them
    ("https://huggingface.co/datasets/HuggingFaceH4/ultrachat_200k", "HuggingFaceH4/ultrachat_200k", None, None,
     "ultrachat_200k"),
    ("https://hf.co/datasets/org/name/viewer/", "org/name", None, None, "name"),
    ("https://huggingface.co/datasets/org/name/viewer/de", "org/name", "de", None, "name-de"),
    ("https://huggingface.co/datasets/HuggingFaceH4/ultrachat_200k/viewer/default/train_sft?row=7",
     "HuggingFaceH4/ultrachat_200k", "default", "train_sft", "ultrachat_200k-train_sft"),
    ("https://huggingface.co/datasets/org/name/viewer/sub%20set/dev.v2/", "org/name", "sub set", "dev.v2",
     "name-sub_set-dev.v2"),
])
def test_a_dataset_s_page_or_viewer_address_names_the_whole_repo_and_its_subset_and_split(url, repo_id, subset,
                                                                                           split, name):
    assert hub_data.parse(url) == hub_data.HubFiles(url, repo_id, None, None, subset, split)
    assert path_problems({"model": "embedded", "data": {"train": url, "val": None, "test": None}}) == []
    assert default_name(url) == name  # a mix's dataset: two splits of one repo are two datasets of their own
    if split is not None:  # the address our messages print for a subset and split reads back as them
        printed = hub_data.viewer_url(repo_id, subset, split)
        assert " " not in printed  # a terminal ends a link at a space
        assert hub_data.parse(printed) == hub_data.HubFiles(printed, repo_id, None, None, subset, split)


def test_a_dataset_s_files_page_at_a_revision_is_the_whole_repo_there_and_a_folder_s_page_is_refused():
    url = "https://huggingface.co/datasets/org/name/tree/refs%2Fconvert%2Fparquet"
    assert hub_data.parse(url) == hub_data.HubFiles(url, "org/name", "refs/convert/parquet", None)
    assert hub_data.parse(f"{url}/default") is None  # a folder in it: `url_problem` asks for a glob


@pytest.mark.parametrize("url", ["hf://datasets/name/x.jsonl", "hf://datasets/org/name@",
                                 "hf://org/name/x.jsonl", "datasets/org/name/x.jsonl", "hf://datasets//name/x"])
def test_a_malformed_hub_url_is_refused_naming_the_key(url):
    assert hub_data.parse(url) is None
    problems = path_problems({"model": "embedded", "data": {"train": url, "val": None, "test": None}})
    local = f"data.train: {url} does not exist"  # not hf://...: a local path, which does not exist
    expected = hub_data.url_problem("data.train", url) if url.startswith("hf://") else local
    assert problems == [expected]


def test_a_folder_s_page_or_a_bare_repo_id_is_refused_with_the_url_to_give():
    """A folder's page may hold several splits' files: the user names them with a glob. `org/name` (as
    `load_dataset` takes it) that is no local path: the hub URL to give."""
    folder = "https://huggingface.co/datasets/org/name/tree/main/data"
    assert hub_data.parse(folder) is None
    assert path_problems({"model": "embedded", "data": {"train": folder, "val": None, "test": None}}) == [
        f"data.train: {folder} is a folder's page; give its files as a glob, e.g. "
        "hf://datasets/org/name@main/data/train-*.parquet"]
    assert path_problems({"model": "embedded", "data": {"train": "teknium/OpenHermes-2.5", "val": "data/v.jsonl",
                                                        "test": None}}) == [
        "data.train: teknium/OpenHermes-2.5 does not exist (a hub dataset is given by URL: "
        "hf://datasets/teknium/OpenHermes-2.5 for its split of data.train, or a file or glob in it, e.g. "
        "hf://datasets/teknium/OpenHermes-2.5/data/train-*.parquet)",
        "data.val: data/v.jsonl does not exist"]


def test_a_file_s_web_address_fetches_that_file_offline_from_the_cache(cache, offline):
    cache_dir, snapshot = cache
    url = f"https://huggingface.co/datasets/{REPO_ID}/blob/main/data/train-00001.parquet"
    got = hub_data.fetch(hub_data.parse(url), cache_dir)
    assert (got.revision, got.paths) == (snapshot.name, [snapshot / "data/train-00001.parquet"])
    assert default_name(url) == "chat-data"


def test_fetching_offline_finds_the_matched_shards_in_the_cache_sorted(cache, offline):
    cache_dir, snapshot = cache
    got = hub_data.fetch(hub_data.parse(f"hf://datasets/{REPO_ID}/data/train-*.parquet"), cache_dir)
    assert got.revision == snapshot.name
    assert got.paths == [snapshot / "data/train-00000.parquet", snapshot / "data/train-00001.parquet"]
    # A pinned revision (a tag pointing at the same commit) finds the same files.
    add_to_cache(cache_dir, REPO_ID, snapshot, ref="v1", repo_type="dataset", commit=snapshot.name)
    assert hub_data.fetch(hub_data.parse(f"hf://datasets/{REPO_ID}@v1/data/train-*.parquet"), cache_dir).paths \
        == got.paths


def test_not_cached_offline_is_one_line_naming_the_url_and_the_command(cache, offline):
    cache_dir, _ = cache
    for url, command in [
        ("hf://datasets/org/other@v2/data/train-*.parquet",
         "hf download org/other --repo-type dataset --revision v2 --include 'data/train-*.parquet'"),
        # The repo is cached, but no file of it matches: those files were never downloaded.
        (f"hf://datasets/{REPO_ID}/data/test-*.parquet",
         f"hf download {REPO_ID} --repo-type dataset --include 'data/test-*.parquet'"),
    ]:
        with pytest.raises(UserError) as err:
            hub_data.fetch(hub_data.parse(url), cache_dir)
        assert str(err.value) == (f"{url} is not in the Hugging Face cache {cache_dir} and HF_HUB_OFFLINE=1 forbids "
                                  f"downloading it: run `{command} --cache-dir {cache_dir}` on a machine with network "
                                  "access (into that cache), or give a local dataset file")


def test_online_a_url_matching_no_file_is_one_line_naming_it(cache, monkeypatch):
    _, snapshot = cache
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub_data, "_snapshot", lambda files, cache, local_only, *patterns: snapshot)  # as downloaded
    url = f"hf://datasets/{REPO_ID}/data/valid-*.parquet"
    with pytest.raises(UserError) as err:
        hub_data.fetch(hub_data.parse(url))
    assert str(err.value) == f"{url}: no file of {REPO_ID} at commit {snapshot.name} matches 'data/valid-*.parquet'"


def test_the_config_check_stops_offline_on_an_uncached_url(cache, offline, monkeypatch):
    cache_dir, _ = cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache_dir))
    cached, missing = f"hf://datasets/{REPO_ID}/data/train-*.parquet", "hf://datasets/org/gone/val.jsonl"
    problems = path_problems({"model": "embedded", "data": {"train": cached, "val": missing, "test": None}})
    assert problems == [f"data.val: {hub_data.not_cached_message(hub_data.parse(missing))}"]
    assert default_name(cached) == "chat-data"


def _pin(tmp_path, cache_dir, url) -> Path:
    out = tmp_path / "results" / "hub" / "train.hub.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(constants, "HF_HUB_CACHE", str(cache_dir))
        assert hub_data.main(["--url", url, "--out", str(out)]) == 0
    return out


def test_a_pin_of_two_shards_reads_as_one_dataset_in_order(cache, offline, tmp_path):
    cache_dir, snapshot = cache
    url = f"hf://datasets/{REPO_ID}/data/train-*.parquet"
    pin = _pin(tmp_path, cache_dir, url)
    assert json.loads(pin.read_text()) == {
        "url": url, "repo_id": REPO_ID, "revision": snapshot.name, "pattern": "data/train-*.parquet",
        "files": [str(snapshot / "data/train-00000.parquet"), str(snapshot / "data/train-00001.parquet")]}

    local = tmp_path / "local.jsonl"
    local.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    from_hub, from_file = parse_file(pin), parse_file(local)
    assert not from_hub.problems and from_hub.layout == "parquet"
    assert [(r.index, r.messages) for r in from_hub.records] == [(r.index, r.messages) for r in from_file.records]
    assert len(from_hub.records) == len(RECORDS)
    # Records are numbered on across the files: what a shard job owns is asked by that number.
    owned = [raw["prompt"] for _, raw in readers.read_raw(pin, "parquet", [], lambda i: i % 3 == 2)
             if raw is not readers.SKIPPED]
    assert owned == [r["prompt"] for r in RECORDS[2::3]]  # records 2 and 5 (the second file's 1)
    # Sharding counts the files' bytes, not the pin's.
    size = sum(Path(f).stat().st_size for f in json.loads(pin.read_text())["files"])
    assert shard_count(pin, size / 2**20 / 2) == 2


def test_a_bad_record_of_a_hub_shard_is_named_by_the_url_record_and_key(cache, offline, tmp_path):
    repo = tmp_path / "bad-repo"
    write_parquet_shards(repo, [*RECORDS[:4], {"prompt": "fine?", "completion": ""}, *RECORDS[4:]], 2)
    cache_dir = tmp_path / "bad-cache"
    add_to_cache(cache_dir, "org/bad", repo, repo_type="dataset")
    url = "hf://datasets/org/bad/data/*.parquet"
    parsed = parse_file(_pin(tmp_path, cache_dir, url))
    assert [(p.file, p.index, p.field) for p in parsed.problems] == [(url, 4, "completion")]
    assert parsed.problems[0].where().startswith(f"{url} (Parquet) record 4")
    with pytest.raises(DataError) as err:  # what evaluation reads the test split with
        load_records(_pin(tmp_path, cache_dir, url))
    assert str(err.value).startswith(f"{url} is not a valid dataset")


def test_a_pin_whose_files_left_the_cache_says_how_to_fetch_them_again(cache, offline, tmp_path):
    cache_dir, snapshot = cache
    pin_url = f"hf://datasets/{REPO_ID}/data/train-00001.parquet"
    pin = _pin(tmp_path, cache_dir, pin_url)
    (snapshot / "data/train-00001.parquet").unlink()
    problem, = parse_file(pin).problems
    assert (problem.file, problem.reason, problem.message) == (
        pin_url,
        "file_not_found", f"{snapshot / 'data/train-00001.parquet'} is no longer in the Hugging Face cache: "
                          f"delete {pin} and run the workflow again to fetch it")


def test_the_run_reads_each_hub_dataset_through_its_pin_and_local_files_as_given():
    from pipeline.data.datasets import RunData
    from pipeline.layout import RunTree

    url = f"hf://datasets/{REPO_ID}/data/train-*.parquet"
    data = {"train": [{"path": url}, {"path": "more.jsonl"}], "val": "hf://datasets/org/v/val.jsonl", "test": None}
    run = RunData({"data": data}, RunTree.of("r"), lambda value, split: value)
    assert {name: s.path for name, s in run.sets.items()} == {
        "chat-data": "results/r/data/hub/train/chat-data.hub.json", "more": "more.jsonl"}
    assert run.split_path("val") == "results/r/data/hub/val.hub.json" and run.split_path("test") is None
    assert run.hub == {"train/chat-data": url, "val": "hf://datasets/org/v/val.jsonl"}


def test_a_pin_over_files_of_several_kinds_is_one_problem_naming_them(tmp_path, offline):
    repo = tmp_path / "mixed-repo"
    write_parquet_shards(repo, RECORDS, 1, pattern="data/b-{:05d}.parquet")
    (repo / "data" / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    cache_dir = tmp_path / "mixed-cache"
    add_to_cache(cache_dir, "org/mixed", repo, repo_type="dataset")
    url = "hf://datasets/org/mixed/data/*"
    problem, = parse_file(_pin(tmp_path, cache_dir, url)).problems
    assert (problem.file, problem.reason, problem.message) == (
        url, "mixed_kinds", "the files are of several kinds: a.jsonl (JSON Lines), b-00000.parquet (Parquet); "
                            "give files of one kind")
