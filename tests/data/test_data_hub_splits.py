"""A hub dataset named by its repo alone (hf://datasets/org/name): the files of the split each config key asks for
(pipeline/data/hub_splits.py), checked against what `datasets` itself chooses for the same repo layout and dataset
card, then fetched offline from a cache laid out as `hf download` leaves it and pinned."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from huggingface_hub import constants
from kits.hub import add_to_cache

from pipeline.data import hub_images, hub_splits
from pipeline.data.formats import load_records
from pipeline.errors import UserError
from pipeline.storage import hub_data

RECORD = json.dumps({"prompt": "q?", "completion": "a."}) + "\n"
ULTRACHAT_LIKE_CARD = """---
license: mit
task_categories:
- text-generation
configs:
- config_name: default
  data_files:
  - split: train_sft
    path: data/train_sft-*
  - split: test_sft
    path: data/test_sft-*
  - split: train_gen
    path: data/train_gen-*
---
# A chat dataset
"""
SUBSETS_CARD = """---
configs:
- config_name: en
  data_files: en/*.jsonl
- config_name: de
  data_files:
  - split: train
    path: de/train-*.jsonl
  - split: validation
    path: de/valid.jsonl
  default: true
---
"""
# name -> (the repo's files, its README.md or None)
LAYOUTS = {
    "push_to_hub": (["data/train-00000-of-00002-a1b2.parquet", "data/train-00001-of-00002-c3d4.parquet",
                     "data/test-00000-of-00001-e5f6.parquet", ".gitattributes"], "---\nlicense: mit\n---\n"),
    "split_folders": (["train/part-0.jsonl", "train/part-1.jsonl", "validation_data/v.jsonl", "other/z.jsonl",
                       "train/images/a.png"], None),
    "split_words_in_names": (["train.jsonl", "dev-v2.jsonl", "my_test.jsonl", "notes.jsonl", "README.md"], None),
    "one_file": (["data.jsonl", "more/extra.jsonl.gz"], "# no card metadata\n"),
    "card_configs": (["data/train_sft-00000-of-00001.parquet", "data/test_sft-00000-of-00001.parquet",
                      "data/train_gen-00000-of-00001.parquet"], ULTRACHAT_LIKE_CARD),
    "default_subset": (["en/a.jsonl", "de/train-0.jsonl", "de/train-1.jsonl", "de/valid.jsonl"], SUBSETS_CARD),
}


def _write(root: Path, names: list[str], readme: str | None) -> Path:
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".parquet"):
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist([json.loads(RECORD)]), path)
        elif name.endswith(".gz"):
            import gzip

            path.write_bytes(gzip.compress(RECORD.encode()))
        else:
            path.write_text(RECORD)
    if readme is not None:
        (root / "README.md").write_text(readme)
    return root


def _listing(root: Path) -> hub_data.Listing:
    names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    readme = root / "README.md"
    return hub_data.Listing("c0ffee", names, readme.read_text() if readme.is_file() else None)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_split_s_files_are_those_datasets_chooses_for_the_same_repo(layout, tmp_path, monkeypatch):
    """`datasets.load_dataset_builder` on the same files, laid out locally, names each split's files: ours for
    train / validation / test are the files of its split of that name (or alias), and a split it lacks is one
    problem naming the splits it has."""
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    root = _write(tmp_path / layout, *LAYOUTS[layout])
    theirs = {str(split): sorted(Path(p).relative_to(root).as_posix() for p in files)
              for split, files in datasets.load_dataset_builder(str(root)).config.data_files.items()}
    listing = _listing(root)
    for split, words in hub_splits.SPLIT_WORDS.items():
        named = [name for name in theirs if name.lower() in words]
        if named:
            assert hub_splits.split_files("hf://datasets/org/x", listing, split) == (named[0], theirs[named[0]])
        else:
            with pytest.raises(UserError) as err:
                hub_splits.split_files("hf://datasets/org/x", listing, split)
            for name in theirs:
                assert f"{name}: {theirs[name][0]}" in str(err.value), (split, str(err.value))


SEVERAL_SPLITS = ["push_to_hub", "split_folders", "split_words_in_names", "card_configs", "default_subset"]


@pytest.mark.parametrize("layout", SEVERAL_SPLITS)
def test_a_local_folder_of_several_splits_reads_the_split_of_the_key_as_datasets_does(layout, tmp_path, monkeypatch):
    """The same repo as `hf download --local-dir` leaves it, given as a local path: `data.train` reads its train
    split, `data.val` its validation split, as `datasets.load_dataset(<folder>)` splits it: through a glob that
    matches exactly those files (or the one file)."""
    import datasets

    from pipeline.data import kinds

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    root = _write(tmp_path / layout, *LAYOUTS[layout])
    theirs = {str(split): sorted(Path(p).relative_to(root).as_posix() for p in files)
              for split, files in datasets.load_dataset_builder(str(root)).config.data_files.items()}
    for split, words in hub_splits.SPLIT_WORDS.items():
        named = [name for name in theirs if name.lower() in words]
        if not named:
            with pytest.raises(UserError, match=f"^{layout}( \\(subset '\\w+'\\))? has no {split} split"):
                hub_splits.folder_split(layout, split)
            continue
        path = hub_splits.folder_split(layout, split)
        matched = kinds.glob_files(path)
        read = [Path(path).relative_to(layout).as_posix()] if matched is None else sorted(
            f.relative_to(layout).as_posix() for f in matched)
        assert read == theirs[named[0]], (split, path)


def test_a_saved_dataset_dict_reads_the_split_of_the_key(tmp_path):
    import datasets

    rows = [{"prompt": "q?", "completion": "a."}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows * 3),
                          "valid": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    dd = str(tmp_path / "dd")
    assert hub_splits.folder_split(dd, "train") == f"{dd}/train"
    assert len(load_records(hub_splits.folder_split(dd, "validation"))) == 1
    with pytest.raises(UserError) as err:
        hub_splits.folder_split(dd, "test")
    assert str(err.value) == (f"{dd}: a DatasetDict without a test split (its splits: train, valid): give one "
                              f"split's folder, e.g. {dd}/train")
    assert hub_splits.folder_split(f"{dd}/train", "test") is None  # a save_to_disk split: itself
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "part-0.jsonl").write_text(RECORD)
    assert hub_splits.folder_split(str(tmp_path / "one"), "test") is None  # a folder of one dataset: itself


def test_a_missing_split_or_several_subsets_is_one_line_with_the_glob_to_give(tmp_path):
    listing = _listing(_write(tmp_path / "chat", *LAYOUTS["card_configs"]))
    with pytest.raises(UserError) as err:
        hub_splits.split_files("hf://datasets/HuggingFaceH4/chat", listing, "train")
    assert str(err.value) == (
        "hf://datasets/HuggingFaceH4/chat has no train split at commit c0ffee (its splits: test_sft: "
        "data/test_sft-00000-of-00001.parquet; train_gen: data/train_gen-00000-of-00001.parquet; train_sft: "
        "data/train_sft-00000-of-00001.parquet): name it by the dataset viewer's address, "
        "https://huggingface.co/datasets/HuggingFaceH4/chat/viewer/default/train_sft, or give that split's files as a "
        "glob, e.g. hf://datasets/HuggingFaceH4/chat/data/train_sft-*.parquet")
    with pytest.raises(UserError) as err:  # at a revision: the viewer shows the default branch only; the glob
        hub_splits.split_files("hf://datasets/HuggingFaceH4/chat@v1", listing, "train")
    assert str(err.value).endswith("): give that split's files as a glob, e.g. "
                                   "hf://datasets/HuggingFaceH4/chat@v1/data/train_sft-*.parquet")
    card = ("---\nconfigs:\n- config_name: default\n  data_files:\n  - {split: dev, path: d.jsonl}\n"
            "  - {split: validation, path: v.jsonl}\n---\n")
    both = hub_data.Listing("c0ffee", ["d.jsonl", "v.jsonl"], card)  # declared both: validation is validation
    assert hub_splits.split_files("hf://datasets/org/x", both, "validation") == ("validation", ["v.jsonl"])
    several = hub_data.Listing("c0ffee", ["en/a.jsonl", "de/b.jsonl"],
                               SUBSETS_CARD.replace("  default: true\n", ""))
    with pytest.raises(UserError) as err:
        hub_splits.split_files("hf://datasets/org/x", several, "train")
    assert str(err.value) == (
        "hf://datasets/org/x has several subsets and none is the default (en, de): name one by the dataset viewer's "
        "address, e.g. https://huggingface.co/datasets/org/x/viewer/en/train, or give one subset's files as a glob "
        "(its card's data_files), hf://datasets/org/x/<path>")


@pytest.mark.parametrize("layout", ["card_configs", "default_subset", "push_to_hub", "split_words_in_names"])
def test_a_split_named_by_the_viewer_s_address_is_the_split_datasets_loads_by_that_name(layout, tmp_path, monkeypatch):
    """`https://huggingface.co/datasets/org/x/viewer/<subset>/<split>` (the browser's address of one split in the
    dataset viewer) names the subset and split as `datasets.load_dataset("org/x", subset, split=split)` does: for
    every subset and split `datasets` finds in the same files, ours are the files of that split; a split or subset
    the repo lacks is one line naming those it has."""
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    root = _write(tmp_path / layout, *LAYOUTS[layout])
    listing = _listing(root)
    card = hub_splits._front_matter(listing.readme) or {}
    subsets = [c["config_name"] for c in card.get("configs", [])] or [hub_splits.DEFAULT_SUBSET]
    for subset in subsets:
        theirs = {str(split): sorted(Path(p).relative_to(root).as_posix() for p in files) for split, files in
                  datasets.load_dataset_builder(str(root), name=subset).config.data_files.items()}
        for name, files in theirs.items():
            url = f"https://huggingface.co/datasets/org/x/viewer/{subset}/{name}"
            files_url = hub_data.parse(url)
            assert (files_url.subset, files_url.split) == (subset, name)
            for key_split in ("train", "test"):  # the split the URL names, whatever the key
                patterns, got = hub_splits.choose(key_split)(files_url, listing)
                assert (got, hub_data._match(root, patterns)) == (name, [root / f for f in files]), (subset, name)
        with pytest.raises(UserError, match=rf"has no Train split at commit c0ffee \(its splits: .*\): name it by the "
                                            rf"dataset viewer's address, https://huggingface.co/datasets/org/x/viewer/"
                                            rf"{subset}/\w+, or give"):
            hub_splits.split_files("https://hf.co/datasets/org/x", listing, "train", subset=subset, named="Train")
    with pytest.raises(UserError) as err:
        hub_splits.split_files("https://hf.co/datasets/org/x/viewer/fr", listing, "train", subset="fr")
    if card.get("configs"):
        assert str(err.value).startswith(f"https://hf.co/datasets/org/x/viewer/fr has no subset 'fr' "
                                         f"({', '.join(subsets)}): name one by the dataset viewer's address, e.g. "
                                         f"https://huggingface.co/datasets/org/x/viewer/{subsets[0]}/train, or give")
    else:
        assert str(err.value) == "https://hf.co/datasets/org/x/viewer/fr has no subset 'fr': its only subset is 'default'"


def test_a_whole_repo_url_fetches_the_split_of_each_key_offline_and_pins_it(tmp_path, monkeypatch):
    """`fetch-data --url hf://datasets/org/name --split validation` (data.val): the repo's validation files at the
    cached commit, pinned with the split's name; the records read through the pin are theirs."""
    repo = _write(tmp_path / "repo", *LAYOUTS["default_subset"])
    cache = tmp_path / "hf-cache"
    snapshot = add_to_cache(cache, "org/multi", repo, repo_type="dataset")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    for split, files in (("train", ["de/train-0.jsonl", "de/train-1.jsonl"]), ("validation", ["de/valid.jsonl"])):
        pin = tmp_path / f"{split}.hub.json"
        assert hub_images.main(["--url", "hf://datasets/org/multi", "--out", str(pin), "--split", split]) == 0
        info = json.loads(pin.read_text())
        assert info["files"] == [str(snapshot / f) for f in files] and info["revision"] == snapshot.name
        assert info["split"] == split and info["pattern"] is None
        assert len(load_records(pin)) == len(files)
    with pytest.raises(UserError, match="has no test split"):
        hub_images.main(["--url", "hf://datasets/org/multi", "--out", str(tmp_path / "t.hub.json"), "--split", "test"])
    # The dataset viewer's address of a subset's split: that split, whichever the key asks for.
    viewer = "https://huggingface.co/datasets/org/multi/viewer/en/train?row=1"
    assert hub_images.main(["--url", viewer, "--out", str(tmp_path / "en.hub.json"), "--split", "test"]) == 0
    info = json.loads((tmp_path / "en.hub.json").read_text())
    assert (info["files"], info["subset"], info["split"]) == ([str(snapshot / "en/a.jsonl")], "en", "train")
    assert not (tmp_path / "t.hub.json").exists()
    # Not cached at all: the one line naming the whole repo's download.
    with pytest.raises(UserError, match="run `hf download org/gone --repo-type dataset --cache-dir"):
        hub_images.main(["--url", "hf://datasets/org/gone", "--out", str(tmp_path / "g.hub.json")])


def test_the_workflow_asks_each_key_s_split():
    from pipeline import layout
    from pipeline.data.datasets import RunData

    data = {"train": "hf://datasets/org/multi", "val": "hf://datasets/org/multi@v1",
            "test": "https://huggingface.co/datasets/org/multi/viewer/default/test_sft",
            "columns": {}, "roles": {}, "max_length": 64, "too_long": "error", "reasoning": "auto",
            "duplicates": "error"}
    run = RunData({"data": data}, layout.RunTree.of("r"), lambda value, split: value)
    assert {key: run.fetch_flags(key) for key in run.hub} == {"train/train": "--split train",
                                                              "val": "--split validation", "test": "--split test"}
    assert os.path.basename(run.sets["train"].path).endswith(".hub.json")


def test_online_the_listing_is_the_commit_the_revision_points_to_now(tmp_path, monkeypatch):
    """Online, the repo is listed at the commit its revision points to (one `dataset_info`), its card read from
    that commit, and the split's files fetched at that same commit, not at whatever the branch is by then. The
    stand-in hub takes the arguments the installed huggingface_hub's functions take."""
    import inspect

    import huggingface_hub

    repo = _write(tmp_path / "repo", *LAYOUTS["push_to_hub"])
    calls = []

    class Hub:
        def dataset_info(self, repo_id, revision=None):
            calls.append(("dataset_info", repo_id, revision))
            return type("Info", (), {"sha": "1" * 40})()

        def list_repo_files(self, repo_id, repo_type=None, revision=None):
            calls.append(("list_repo_files", repo_id, repo_type, revision))
            return [p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file()]

    def download(repo_id, filename, repo_type=None, revision=None, cache_dir=None):
        calls.append(("hf_hub_download", filename, revision))
        return str(repo / filename)

    for name, ours in (("dataset_info", Hub.dataset_info), ("list_repo_files", Hub.list_repo_files)):
        real = inspect.signature(getattr(huggingface_hub.HfApi, name)).parameters
        assert all(p in real for p in list(inspect.signature(ours).parameters)[1:]), name
    assert all(p in inspect.signature(huggingface_hub.hf_hub_download).parameters
               for p in inspect.signature(download).parameters)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "HfApi", Hub)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    fetched = []
    monkeypatch.setattr(hub_data, "_snapshot", lambda files, cache, local_only, patterns, revision:
                        fetched.append((local_only, patterns, revision)) or repo)
    out = tmp_path / "train.hub.json"
    hub_data.write_pin("hf://datasets/org/pushed@main", out, choose=hub_splits.choose("test"))
    assert calls == [("dataset_info", "org/pushed", "main"), ("list_repo_files", "org/pushed", "dataset", "1" * 40),
                     ("hf_hub_download", "README.md", "1" * 40)]
    assert fetched == [(False, ["data/test-00000-of-00001-e5f6.parquet"], "1" * 40)]
    assert json.loads(out.read_text())["files"] == [str(repo / "data/test-00000-of-00001-e5f6.parquet")]
