"""A base model given by Hugging Face hub id: fetched once into the Hugging Face cache, read from there.

    python -m pipeline fetch-model --model org/name[@revision] --out results/<run>/model.json

`model:` in config/config.yaml is an embedded name, a local model directory, or
a hub id `org/name`, optionally pinned as `org/name@revision` (a branch, tag or
commit). A hub id is downloaded by one job, `fetch_model`, that runs where
Snakemake runs (compute nodes often have no network), into the Hugging Face
cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else ~/.cache/huggingface/hub) as
`hf download` leaves it. It writes `model.json`: the repo id, the commit it got
(`revision`, a sha) and the snapshot directory. Every later job is given that
file (or the hub id) as its model and reads the snapshot of that commit from
the cache, never from the network (`model_dir`, the one helper every command
calls). With `HF_HUB_OFFLINE=1` the same job only looks the model up in the
cache; when it is not there the workflow stops as it loads, with one line
saying how to fetch it (`not_cached_message`).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pipeline.errors import UserError

T = TypeVar("T")

# org/name, optionally @revision (a branch, tag or commit sha; branch names may hold "/").
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w.][\w./-]*))?$")
MODEL_INFO_KEYS = ("repo_id", "revision", "path")


@dataclass(frozen=True)
class HubModel:
    repo_id: str
    revision: str | None = None  # as asked for; None: the default branch

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class Snapshot:
    repo_id: str
    revision: str  # the commit sha
    path: Path  # <cache>/models--org--name/snapshots/<sha>

    def info(self) -> dict:
        return {"repo_id": self.repo_id, "revision": self.revision, "path": str(self.path)}


def parse(value: str) -> HubModel | None:
    """The hub id `value` spells (`org/name` or `org/name@revision`), or None."""
    m = _HUB_ID.match(str(value))
    return HubModel(m["repo"], m["rev"]) if m else None


def offline() -> bool:
    """HF_HUB_OFFLINE is set: nothing may be downloaded."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cache_dir() -> Path:
    """The Hugging Face hub cache this process uses (HF_HUB_CACHE, else HF_HOME/hub, else the default)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def cached(model: HubModel, cache: Path | None = None) -> Snapshot | None:
    """The model's snapshot in the cache, looked up without the network; None when it is not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(model.repo_id, revision=model.revision, cache_dir=cache, local_files_only=True)
    except LocalEntryNotFoundError:
        return None
    path = Path(path)
    return Snapshot(model.repo_id, path.name, path) if path.is_dir() else None


def not_cached_message(model: HubModel, cache: Path | None = None) -> str:
    """One line: the id, the cache it is not in, and the two ways on."""
    where = cache or cache_dir()
    rev = f" --revision {model.revision}" if model.revision else ""
    why = " and HF_HUB_OFFLINE=1 forbids downloading it" if offline() else ""
    return (f"model: {model} is not in the Hugging Face cache {where}{why}: "
            f"run `hf download {model.repo_id}{rev} --cache-dir {where}` on a machine with network access "
            f"(into that cache), or set model: to a local model directory")


def download(what: str, online: Callable[[], T], cached_only: Callable[[], T | None], not_cached: str) -> T:
    """A download from the hub, the one way models and datasets both go: offline (HF_HUB_OFFLINE), what
    `cached_only()` finds in the cache, else a UserError saying `not_cached`; online, `online()`, whose
    failures (no network and nothing cached; a repo, revision or file not found; no access) are a UserError
    naming `what`."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    if offline():
        found = cached_only()
        if found is None:
            raise UserError(not_cached)
        return found
    try:
        return online()
    except UserError:
        raise
    except LocalEntryNotFoundError:  # no network, nothing cached
        raise UserError(f"cannot reach the Hugging Face hub; {not_cached}") from None
    except Exception as err:  # repo or revision not found, gated, no access ...
        raise UserError(f"cannot download {what} from the Hugging Face hub: {type(err).__name__}: {err}") from None


def fetch(model: HubModel, cache: Path | None = None) -> Snapshot:
    """Download the model into the cache (offline: only look it up there) and return its snapshot."""
    from huggingface_hub import snapshot_download

    def online() -> Snapshot:
        path = Path(snapshot_download(model.repo_id, revision=model.revision, cache_dir=cache))
        return Snapshot(model.repo_id, path.name, path)

    return download(str(model), online, lambda: cached(model, cache), not_cached_message(model, cache))


def read_info(path: Path) -> dict:
    """A model.json written by `fetch-model`: {repo_id, revision, path}."""
    try:
        info = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read the fetched model's record {path}: {err}") from None
    if not isinstance(info, dict) or any(k not in info for k in MODEL_INFO_KEYS):
        raise UserError(f"{path} is not a model record written by `fetch-model` (keys {', '.join(MODEL_INFO_KEYS)})")
    return info


def pinned(value: str | Path) -> HubModel | None:
    """The hub model a model argument names, at the commit it is pinned to when it is a model.json."""
    path = Path(value)
    if path.suffix == ".json" and path.is_file():
        info = read_info(path)
        return HubModel(info["repo_id"], info["revision"])
    return None if path.exists() else parse(str(value))


def snapshot(value: str | Path) -> Snapshot | None:
    """The cached snapshot a hub model argument (a model.json or a hub id) names; None for anything else.

    Looked up without the network; not cached: a `UserError` saying how to fetch it.
    """
    model = None if Path(value).is_dir() else pinned(value)
    if model is None:
        return None
    found = cached(model)
    if found is None:
        raise UserError(not_cached_message(model))
    return found


def model_dir(value: str | Path) -> Path:
    """The local directory of a model argument: what every command reading the base model calls.

    A directory is itself; a model.json (written by `fetch-model`) or a hub id is
    the cached snapshot of its commit (`snapshot`); anything else comes back
    unchanged (the caller says what is wrong with it).
    """
    found = snapshot(value)
    return found.path if found is not None else Path(value)


def describe(value: str | Path) -> dict | None:
    """{repo_id, revision (the commit sha)} of a hub model argument, for the plan; None for a local dir."""
    found = snapshot(value)
    return {"repo_id": found.repo_id, "revision": found.revision} if found is not None else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline fetch-model", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="hub id: org/name or org/name@revision")
    ap.add_argument("--out", required=True, type=Path, help="model.json to write: repo_id, revision (sha), path")
    args = ap.parse_args(argv)
    model = parse(args.model)
    if model is None:
        raise UserError(f"--model {args.model} is not a hub id like org/name or org/name@revision")
    snap = fetch(model)
    from pipeline.storage.publish import write_text

    write_text(args.out, json.dumps(snap.info(), indent=2) + "\n")
    print(f"{model}: commit {snap.revision} in {snap.path}")
    return 0
