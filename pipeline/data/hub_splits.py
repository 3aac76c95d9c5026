"""A hub dataset named by its repo alone (``hf://datasets/org/name[@revision]``): which of its files are the split a
config key asks for, chosen as `datasets.load_dataset("org/name", split=...)` chooses them. A local folder holding
several splits (`folder_split`: a DatasetDict saved to disk, a dataset repo as ``hf download --local-dir`` leaves
it) is read the same way: its split of the key.

``data.train`` asks for the repo's ``train`` split, ``data.val`` for its validation split (declared as
``validation``, ``valid``, ``val`` or ``dev``), ``data.test`` for ``test``. Where the files come from:

1. The dataset card's YAML (README.md) ``configs:``: the one marked ``default: true``, else the one named
   ``default``, else the only one; its ``data_files`` (a path or glob, a list of them, or a list of
   ``{split, path}``) name each split's files. Several subsets and none the default: one problem listing them.
2. Else the repo's own layout, in the order `datasets` tries it: shards named ``data/<split>-00000-of-00002...``
   (what ``push_to_hub`` writes); else split folders (``train/``, ``validation_data/``, ...: a folder whose
   name starts with a split's word); else split words in file names (``train.jsonl``, ``dev-v2.json``); else
   every data file is ``train``.

The dataset viewer's address of a split (``https://huggingface.co/datasets/org/name/viewer/<subset>/<split>``)
names the subset (a card config's name; ``default`` for a repo whose card declares none) and the split by their
exact names, as `datasets.load_dataset("org/name", "<subset>", split="<split>")` does, whatever the key.

A split the repo does not have is one problem naming the splits it has, each with its files, so the user can
name one by its viewer address or give it as a glob (``hf://datasets/org/name/data/train_sft-*``).
The files chosen are fetched at the listing's commit and pinned as any hub URL's (`pipeline.storage.hub_data`).
"""

from __future__ import annotations

import fnmatch
import glob
import json
import os
import posixpath
import re
from pathlib import Path, PurePosixPath
from urllib.parse import quote

import yaml

from pipeline.data import kinds
from pipeline.data.kinds import data_name
from pipeline.errors import UserError
from pipeline.storage import hub_data
from pipeline.storage.hub_data import HubFiles, Listing, viewer_url

# The words that name each split (as `datasets` names them); the first is the split's own name.
SPLIT_WORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
KEY_SPLIT = {"train": "train", "val": "validation", "test": "test"}  # a config key (fetch_data's) -> its split
DEFAULT_SUBSET = "default"  # the subset of a repo whose card declares no configs, as `datasets` names it
_SHARDED = re.compile(r"^data/(?P<split>[^/]+?)-\d{5}-of-\d{5}[^/]*$")
_SEPARATORS = re.compile(r"[-._ 0-9]+")
_SHOWN = 3  # files shown per split in a problem


def split_of_key(key: str) -> str:
    """The split `fetch_data`'s key asks for: ``train/<name>`` and ``train`` -> train, ``val``, ``test``."""
    return KEY_SPLIT[key.split("/")[0]]


def choose(split: str):
    """A `hub_data.write_pin` chooser: the files of `split` in a listed repo (or of the split and subset the URL
    names: the dataset viewer's address), as exact patterns, and the split's name in the repo."""

    def chosen(files: HubFiles, listing: Listing) -> tuple[list[str], str]:
        name, names = split_files(files.url, listing, split, subset=files.subset, named=files.split)
        return [glob.escape(n) for n in names], name

    return chosen


def split_files(url: str, listing: Listing, split: str, *, subset: str | None = None,
                named: str | None = None) -> tuple[str, list[str]]:
    """(the split's name in the repo, its files' paths in the repo, sorted) for `split` (train / validation /
    test; or the split `named`, by its exact name) of the default subset (or of `subset`, by its config name);
    `UserError` when the repo does not have it, naming the splits (or subsets) it has."""
    where, at = url, f" at commit {listing.revision}" if listing.revision else ""
    declared = _card_splits(url, listing, subset, split)
    if declared is not None:
        config, patterns = declared
        where = f"{url} (subset {config!r})" if config else url
        splits = {name: _matching(listing.names, globs) for name, globs in patterns.items()}
    elif subset not in (None, DEFAULT_SUBSET):  # no configs on the card: one subset, as `datasets` names it
        raise UserError(f"{url} has no subset {subset!r}: its only subset is {DEFAULT_SUBSET!r}")
    else:
        splits = _layout_splits([n for n in listing.names if _is_data(n)])
    for word in (named,) if named else SPLIT_WORDS[split]:  # a repo with both `validation` and `dev`: validation
        for name, found in splits.items():
            if (name if named else name.lower()) == word and found:
                return name, found
    base, repo = _whole_repo(url)
    if not any(splits.values()):
        raise UserError(f"{where}: no data file{at} ({len(listing.names)} file(s) listed): give the file or glob "
                        f"in it, {_url_with(base, '<path>')}")
    have = "; ".join(f"{name}: {', '.join(found[:_SHOWN])}{', ...' if len(found) > _SHOWN else ''}"
                     for name, found in sorted(splits.items()) if found)
    like = [(name, found) for name, found in splits.items()
            if found and set(_words(name)) & set(SPLIT_WORDS[split])]
    example, files = (like or [(name, found) for name, found in splits.items() if found])[0]  # train_sft for train
    config = declared[0] if declared is not None else None
    by_name = (f"name it by the dataset viewer's address, {viewer_url(repo, config or DEFAULT_SUBSET, example)}, or "
               if repo else "")
    raise UserError(f"{where} has no {named or split} split{at} (its splits: {have}): {by_name}give that "
                    f"split's files as a glob, e.g. {_url_with(base, _glob_of(files[0]))}")


def _whole_repo(url: str) -> tuple[str, str | None]:
    """(the URL a path in the repo is appended to, the repo id when the dataset viewer's address can name one of its
    splits: a hub URL of the default branch) for a URL naming a whole repo; a local folder's path is itself."""
    files = hub_data.parse(url) if hub_data.is_url(url) else None
    if files is None:
        return url, None
    rev = f"@{quote(files.revision, safe='')}" if files.revision else ""
    return f"hf://datasets/{files.repo_id}{rev}", None if files.revision else files.repo_id


def _is_data(name: str) -> bool:
    return data_name(PurePosixPath(name)) and not any(part.startswith(".") for part in name.split("/"))


def _matching(names: list[str], patterns: list[str]) -> list[str]:
    """The files the card's patterns match (as `hf download --include` matches: ``*`` crosses ``/``)."""
    return sorted({n for n in names for p in patterns if fnmatch.fnmatchcase(n, p)})


def _card_splits(url: str, listing: Listing, subset: str | None,
                 split: str) -> tuple[str | None, dict[str, list[str]]] | None:
    """The splits the dataset card declares for `subset` (by its config name; None: the default subset): (its name,
    split -> patterns); None when the card declares no configs."""
    card = _front_matter(listing.readme)
    configs = card.get("configs") if isinstance(card, dict) else None
    if not isinstance(configs, list) or not configs:
        return None
    configs = [c for c in configs if isinstance(c, dict)]
    names = [str(c.get("config_name", DEFAULT_SUBSET)) for c in configs]
    if subset is not None:
        chosen = [c for c, name in zip(configs, names) if name == subset]
    else:
        chosen = ([c for c in configs if c.get("default") is True] or
                  [c for c, name in zip(configs, names) if name == DEFAULT_SUBSET] or
                  (configs if len(configs) == 1 else []))
    if not chosen:
        base, repo = _whole_repo(url)
        by_name = (f"name one by the dataset viewer's address, e.g. {viewer_url(repo, names[0], split)}, or give "
                   if repo else "give ")
        why = f"has no subset {subset!r}" if subset is not None else "has several subsets and none is the default"
        raise UserError(f"{url} {why} ({', '.join(names)}): {by_name}one subset's files as a glob (its card's "
                        f"data_files), {_url_with(base, '<path>')}")
    config = chosen[0]
    name = str(config.get("config_name", DEFAULT_SUBSET))
    return (None if name == DEFAULT_SUBSET else name), _data_files(config.get("data_files"))


def _data_files(value) -> dict[str, list[str]]:
    """A config's data_files, every form the card allows, as split -> patterns."""
    as_list = lambda v: [str(v)] if isinstance(v, str) else [str(x) for x in v or []]
    if value is None:
        return {}
    if isinstance(value, str):
        return {"train": [value]}
    if isinstance(value, dict):
        return {str(split): as_list(paths) for split, paths in value.items()}
    out: dict[str, list[str]] = {}
    for entry in value:
        if isinstance(entry, dict) and "split" in entry:
            out.setdefault(str(entry["split"]), []).extend(as_list(entry.get("path")))
        else:
            out.setdefault("train", []).extend(as_list(entry))
    return out


def _front_matter(readme: str | None):
    if not readme or not readme.startswith("---"):
        return None
    end = readme.find("\n---", 3)
    try:
        return yaml.safe_load(readme[3:end] if end != -1 else "")
    except yaml.YAMLError:
        return None


def _layout_splits(names: list[str]) -> dict[str, list[str]]:
    """Splits by the repo's layout: push_to_hub's shards, else split folders, else split words in file names,
    else every data file is train."""
    sharded: dict[str, list[str]] = {}
    for n in names:
        m = _SHARDED.match(n)
        if m:
            sharded.setdefault(m["split"], []).append(n)
    if sharded:
        return sharded
    for by_folder in (True, False):
        found: dict[str, list[str]] = {}
        for n in names:
            split = _split_named(n, by_folder)
            if split:
                found.setdefault(split, []).append(n)
        if found:
            return found
    return {"train": list(names)} if names else {}


def _split_named(name: str, by_folder: bool) -> str | None:
    """The split a file's folders name (a folder whose name's first word is a split word), or its file name does
    (any of its words)."""
    parts = name.split("/")
    if by_folder:
        words = [_words(folder)[:1] for folder in parts[:-1]]
    else:
        words = [_words(parts[-1])]
    for split, keywords in SPLIT_WORDS.items():
        if any(w in keywords for group in words for w in group):
            return split
    return None


def _words(text: str) -> list[str]:
    return [w for w in _SEPARATORS.split(text.lower()) if w]


def _glob_of(name: str) -> str:
    """A glob over a split's shards from one of its files: its shard number and count made wildcards."""
    return re.sub(r"\d{5}-of-\d{5}", "*", name) if re.search(r"\d{5}-of-\d{5}", name) else name


def _url_with(url: str, path: str) -> str:
    return f"{url.rstrip('/')}/{path}"


def folder_split(path: str, split: str) -> str | None:
    """The path to read for `split` (train / validation / test) of a local folder holding several splits, as
    `datasets.load_dataset(<folder>, split=...)` reads it; None for anything else (a file, a glob, a folder of one
    dataset, a save_to_disk split). A DatasetDict saved to disk: its split's folder. A dataset repo's folder whose
    files name several splits: a glob matching exactly the split's data files (``nr/data/train-*``).
    `UserError` when it has no such split, naming those it has."""
    root = Path(os.path.expanduser(path))
    if not root.is_dir():
        return None
    dict_file = root / "dataset_dict.json"
    if dict_file.is_file():
        try:
            names = [str(n) for n in json.loads(dict_file.read_text())["splits"]]
        except (OSError, ValueError, KeyError, TypeError):
            names = sorted(p.name for p in root.iterdir() if p.is_dir())
        found = [n for n in names if n.lower() in SPLIT_WORDS[split] and (root / n).is_dir()]
        if not found:
            raise UserError(f"{path}: a DatasetDict without a {split} split (its splits: {', '.join(names)}): "
                            f"give one split's folder, e.g. {os.path.join(path, names[0]) if names else path}")
        return os.path.join(path, found[0])
    try:
        kinds.shard_files(root)
        return None  # one dataset (or none: validation says so)
    except kinds.KindError:
        pass  # several splits' files
    names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    readme = root / "README.md"
    listing = Listing("", names, readme.read_text(encoding="utf-8", errors="replace")
                      if readme.is_file() else None)
    try:
        _, files = split_files(path, listing, split)
    except UserError as err:
        skip = {"validation": "data.val", "test": "data.test"}.get(split)
        raise UserError(f"{err}{f' (or {skip}: null to go without one)' if skip else ''}") from None
    if len(files) == 1:
        return os.path.join(path, files[0])
    for candidate in _globs_for(files):
        given = os.path.join(path, candidate)
        try:
            matched = kinds.glob_files(given)  # as the readers will read it
        except kinds.KindError:
            continue
        if matched is not None and sorted(f.relative_to(root).as_posix() for f in matched) == files:
            return given
    raise UserError(f"{path}: its {split} split is {', '.join(files[:_SHOWN])}{', ...' if len(files) > _SHOWN else ''}"
                    ", files no one glob names: give them as a glob or a folder of their own")


def _globs_for(files: list[str]) -> list[str]:
    """Globs that may name exactly `files` (paths in a folder): their folder's files sharing the start of their
    names up to a separator (``data/train-*``); their whole folder, at any depth."""
    folder = _common_folder(files)
    names = [f[len(folder) + 1:] if folder else f for f in files]
    prefix = os.path.commonprefix(names)
    cut = max((i + 1 for i, c in enumerate(prefix) if not c.isalnum()), default=0)  # up to its last separator
    base = f"{glob.escape(folder)}/" if folder else ""
    out = [f"{base}{glob.escape(prefix[:cut])}*"] if cut else []
    return out + ([f"{base}**/*"] if folder else [])


def _common_folder(files: list[str]) -> str:
    """The folder all `files` are in ('' for the top)."""
    return posixpath.commonpath([posixpath.dirname(f) for f in files]) if files else ""
