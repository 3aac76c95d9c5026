"""A model given by hub id (`pipeline.storage.hub`): what counts as one, its lookup in a Hugging Face
cache laid out as `hf download` leaves it (tests/kits/hub.py), the commit a model.json pins, and the
one line that says how to fetch a model that is not cached."""

from __future__ import annotations

import json
import os
from pathlib import Path

import huggingface_hub.constants
import huggingface_hub.errors
import pytest
import yaml
from kits.hub import add_to_cache
from kits.train import resolved_config

from pipeline import config as train_config
from pipeline.planning import plan
from pipeline.errors import UserError
from pipeline.storage import hub
from pipeline.workflow_config import path_problems

CONF = Path(__file__).resolve().parents[2] / "config" / "train"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache this process uses, online unless a test says otherwise."""
    path = tmp_path / "hf-cache"
    path.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return path


def _model(tmp_path: Path, name: str, text: str = "x") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "note": text}))
    (d / "tokenizer.json").write_text("{}")
    return d


@pytest.mark.parametrize("value, expected", [
    ("meta-llama/Llama-3.2-1B-Instruct", hub.HubModel("meta-llama/Llama-3.2-1B-Instruct")),
    ("org/name@v1.0", hub.HubModel("org/name", "v1.0")),
    ("org/name@refs/pr/3", hub.HubModel("org/name", "refs/pr/3")),
    ("org/name@" + "a" * 40, hub.HubModel("org/name", "a" * 40)),
    ("gpt2", None), ("./org/name", None), ("/abs/org/name", None), ("org/name/extra", None), ("org/name@", None),
])
def test_a_hub_id_is_org_slash_name_with_an_optional_revision(value, expected):
    assert hub.parse(value) == expected
    if expected is not None:
        assert str(expected) == value


def test_model_config_is_an_embedded_name_a_local_dir_or_a_hub_id(tmp_path):
    ok = {"data": {"train": "embedded"}}
    assert path_problems({**ok, "model": "org/name@main"}) == []
    assert path_problems({**ok, "model": "embedded"}) == []
    assert path_problems({**ok, "model": str(_model(tmp_path, "m"))}) == []
    assert path_problems({**ok, "model": "gpt2"}) == [
        "model: gpt2 does not exist (and is not a hub id like org/name or org/name@revision)"]


def test_the_test_cache_is_laid_out_as_hf_download_leaves_it(tmp_path, cache):
    snap = add_to_cache(cache, "org/name", _model(tmp_path, "m"))
    repo = cache / "models--org--name"
    assert (repo / "refs" / "main").read_text() == snap.name and len(snap.name) == 40
    for f in snap.iterdir():
        assert f.is_symlink() and not os.path.isabs(os.readlink(f))
        assert f.resolve().parent == (repo / "blobs").resolve()
    # huggingface_hub itself reads it as a cached repo
    info = huggingface_hub.scan_cache_dir(cache)
    assert [(r.repo_id, [rev.commit_hash for rev in r.revisions]) for r in info.repos] == [("org/name", [snap.name])]


def test_a_cached_model_is_found_by_branch_tag_or_commit_without_the_network(tmp_path, cache):
    model = _model(tmp_path, "m")
    snap = add_to_cache(cache, "org/name", model)
    assert add_to_cache(cache, "org/name", model, ref="v1") == snap
    for model in (hub.HubModel("org/name"), hub.HubModel("org/name", "v1"), hub.HubModel("org/name", snap.name)):
        assert hub.cached(model) == hub.Snapshot("org/name", snap.name, snap)
    assert hub.cached(hub.HubModel("org/name", "v2")) is None
    assert hub.cached(hub.HubModel("org/other")) is None


def test_model_dir_reads_a_model_json_at_its_pinned_commit_even_after_main_moved(tmp_path, cache):
    old = add_to_cache(cache, "org/name", _model(tmp_path, "m1", "old"))
    record = tmp_path / "model.json"
    record.write_text(json.dumps(hub.Snapshot("org/name", old.name, old).info()))
    new = add_to_cache(cache, "org/name", _model(tmp_path, "m2", "new"))  # refs/main -> a newer commit
    assert new != old
    assert hub.model_dir(record) == old
    assert hub.model_dir("org/name") == new
    assert hub.describe(record) == {"repo_id": "org/name", "revision": old.name}
    local = _model(tmp_path, "local")
    assert hub.model_dir(local) == local and hub.describe(local) is None
    assert hub.model_dir("not/../a model") == Path("not/../a model")  # left for the caller to refuse


def test_not_cached_is_one_line_with_the_cache_and_both_ways_on(cache, monkeypatch):
    with pytest.raises(UserError) as err:
        hub.model_dir("org/name@v1")
    assert str(err.value) == (f"model: org/name@v1 is not in the Hugging Face cache {cache}: run "
                              f"`hf download org/name --revision v1 --cache-dir {cache}` on a machine with network "
                              "access (into that cache), or set model: to a local model directory")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    line = hub.not_cached_message(hub.HubModel("org/name"))
    assert "\n" not in line
    assert line.startswith(f"model: org/name is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE=1 forbids "
                           "downloading it: run `hf download org/name --cache-dir")


def test_fetch_model_offline_pins_the_cached_commit_and_refuses_a_missing_one(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    snap = add_to_cache(cache, "org/name", _model(tmp_path, "m"))
    out = tmp_path / "run" / "model.json"
    assert hub.main(["--model", "org/name", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == {"repo_id": "org/name", "revision": snap.name, "path": str(snap)}
    with pytest.raises(UserError, match="org/missing is not in the Hugging Face cache"):
        hub.main(["--model", "org/missing", "--out", str(tmp_path / "other.json")])
    with pytest.raises(UserError, match="not a hub id"):
        hub.main(["--model", "gpt2", "--out", str(tmp_path / "other.json")])


def test_plan_records_the_hub_id_and_commit_and_jobs_load_the_snapshot(tiny, tmp_path, cache):
    snap = add_to_cache(cache, "org/tiny", Path(tiny["model"]))
    record = tmp_path / "model.json"
    record.write_text(json.dumps(hub.Snapshot("org/tiny", snap.name, snap).info()))
    overrides = [f"model.path={record}", f"tokens.train_cache={tiny['train']}", "ema.rates=[0.9]"]
    args = ["--total-updates", "4", "--pilot-fraction", "0.5", "--num-chunks", "1", *resolved_config(overrides),
            "--export-weights", "raw",
            "--out-plan", str(tmp_path / "plan.json"), "--out-config", str(tmp_path / "train_config.yaml")]
    assert plan.main(args) == 0
    assert json.loads((tmp_path / "plan.json").read_text())["model"] == {"repo_id": "org/tiny", "revision": snap.name}
    # train_config.yaml keeps the model.json (the config's identity); a job loading it reads the snapshot
    written = train_config.to_typed(yaml.safe_load((tmp_path / "train_config.yaml").read_text()))
    assert written.model.path == str(record)
    assert train_config.to_yaml(written) == train_config.to_yaml(train_config.resolve(CONF, "config", overrides))
    assert train_config.load(tmp_path / "train_config.yaml").model.path == str(snap)


def test_fetch_model_online_downloads_into_the_cache_and_pins_the_commit_it_got(tmp_path, cache, monkeypatch):
    model = _model(tmp_path, "m")
    calls = []

    def download(repo_id, *, revision=None, cache_dir=None, local_files_only=False, **kw):
        calls.append((repo_id, revision, local_files_only))
        if repo_id == "org/unreachable":
            raise huggingface_hub.errors.LocalEntryNotFoundError("cannot reach the hub")
        return str(add_to_cache(cache, repo_id, model, ref=revision or "main"))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    out = tmp_path / "model.json"
    assert hub.main(["--model", "org/name@v2", "--out", str(out)]) == 0
    assert calls == [("org/name", "v2", False)]  # a real download, not a cache lookup
    record = json.loads(out.read_text())
    assert record["repo_id"] == "org/name" and (cache / "models--org--name/refs/v2").read_text() == record["revision"]
    with pytest.raises(UserError, match=r"cannot reach the Hugging Face hub; model: org/unreachable is not in"):
        hub.main(["--model", "org/unreachable", "--out", str(tmp_path / "other.json")])
