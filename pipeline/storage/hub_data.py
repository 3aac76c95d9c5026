"""Dataset files given by Hugging Face hub URL: fetched once into the Hugging Face cache, read from there.

    python -m pipeline fetch-data --url hf://datasets/org/name[@revision]/<path or glob> --out <pin>.hub.json

`data.train` / `data.val` / `data.test` (and a `data.train` list entry's `path`)
may be the URL the hub's "Use this dataset" pandas snippet shows, huggingface_hub's
HfFileSystem path: ``hf://datasets/<org>/<name>[@<revision>]/<path in the repo>``
(or a file's address in a browser, ``https://huggingface.co/datasets/<org>/<name>/blob/<revision>/<path>``;
or the repo alone, ``hf://datasets/<org>/<name>``, whose files of the split a key asks for are chosen from its
`listing` by `pipeline.data.hub_splits`; or the dataset viewer's address of one split,
``https://huggingface.co/datasets/<org>/<name>/viewer/<subset>/<split>``, which names the split itself),
the path a file or a glob over several (``data/train-*.parquet``; matched as
`hf download --include` matches, so ``*`` also crosses ``/``). One job,
`fetch_data`, run where Snakemake runs (compute nodes often have no network),
downloads the matching files of that revision into the Hugging Face cache as
`hf download --repo-type dataset` leaves them and writes a pin
(results/<run>/data/hub/<split or train/name>.hub.json): the URL, the repo, the
commit it got and the matched files in the cache snapshot, sorted. Every later
job is given the pin as the dataset path and reads those files, in that order,
as one dataset (`pipeline.data.readers`): a rerun reads the same commit. With
`HF_HUB_OFFLINE=1` the files are only looked up in the cache; not there, the
workflow stops as it loads with one line saying how to fetch them
(`not_cached_message`).

Light on purpose (json, re; huggingface_hub only inside the functions that fetch):
the Snakefile and every reader import it.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import quote, unquote

from pipeline.errors import UserError
from pipeline.layout import HUB_PIN_SUFFIX as PIN_SUFFIX  # a JSON dataset is an array, a pin an object with PIN_KEYS

PIN_KEYS = ("url", "repo_id", "revision", "files")
# hf://datasets/org/name[@revision]/path; a revision holding "/" is written %2F, as HfFileSystem does.
_URL = re.compile(r"^hf://datasets/(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[^/]+))?"
                  r"(?:/(?P<path>[^/].*)|/?)$")
# A file's address on the hub's web pages, as a browser shows it: its page (/blob/) or its download link
# (/resolve/), with the branch, tag or commit it is at; a folder's page (/tree/) is refused (`url_problem`).
_WEB_PREFIXES = ("https://huggingface.co/datasets/", "https://hf.co/datasets/")
_WEB = re.compile(r"^https://(?:huggingface|hf)\.co/datasets/(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)"
                  r"/(?P<kind>blob|resolve|tree)/(?P<rev>[^/?#]+)/(?P<path>[^/?#][^?#]*?)/?(?:[?#].*)?$")
# A dataset's page or its files' page at a revision (/tree/<revision>: the whole repo), or its viewer's address as
# the browser shows it: the repo's viewer, a subset's, or one split's of a subset
# (https://huggingface.co/datasets/HuggingFaceH4/ultrachat_200k/viewer/default/train_sft?row=3).
_VIEWER = re.compile(r"^https://(?:huggingface|hf)\.co/datasets/(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)"
                     r"(?:/viewer(?:/(?P<subset>[^/?#]+)(?:/(?P<split>[^/?#]+))?)?|/tree/(?P<rev>[^/?#]+))?"
                     r"/?(?:[?#].*)?$")


@dataclass(frozen=True)
class HubFiles:
    """Files of a dataset repo on the hub, as one hub URL names them."""

    url: str  # as the config gives it
    repo_id: str
    revision: str | None  # as asked for; None: the default branch
    pattern: str | None  # a path in the repo, or a glob over several; None: the whole repo (its split of a key)
    subset: str | None = None  # the whole repo: the subset (config) the dataset viewer's address names
    split: str | None = None  # the whole repo: the split the dataset viewer's address names (else the key's)

    def download_command(self, cache: Path) -> str:
        rev = f" --revision {self.revision}" if self.revision else ""
        include = f" --include '{self.pattern}'" if self.pattern else ""
        return f"hf download {self.repo_id} --repo-type dataset{rev}{include} --cache-dir {cache}"


def is_url(value) -> bool:
    """`value` is meant as a hub dataset URL (it starts hf://, or https:// on a dataset's web pages), well
    formed or not."""
    return isinstance(value, str) and value.startswith(("hf://", *_WEB_PREFIXES))


def parse(value: str) -> HubFiles | None:
    """The hub files `value` names (`hf://datasets/org/name[@revision]/path`; a file's web page or download
    link, `https://huggingface.co/datasets/org/name/blob/<revision>/path`), or None."""
    m = _URL.match(str(value))
    if m and (m["path"] or not looks_like_file(m["repo"])):  # hf://datasets/name/x.jsonl: a file, not a repo
        path = m["path"].rstrip("/") if m["path"] else None
        return HubFiles(str(value), m["repo"], unquote(m["rev"]) if m["rev"] else None, path)
    m = _WEB.match(str(value))
    if m and m["kind"] != "tree":
        return HubFiles(str(value), m["repo"], unquote(m["rev"]), glob.escape(unquote(m["path"])))  # one file
    m = _VIEWER.match(str(value))
    if m:
        name = lambda part: unquote(m[part]) if m[part] else None
        return HubFiles(str(value), m["repo"], name("rev"), None, name("subset"), name("split"))
    return None


def viewer_url(repo_id: str, subset: str, split: str) -> str:
    """The dataset viewer's address of one split of a subset: a hub dataset URL that names the split (a name with a
    space or a slash quoted, as the browser writes it)."""
    return f"https://huggingface.co/datasets/{repo_id}/viewer/{quote(subset, safe='')}/{quote(split, safe='')}"


_FILE_NAME = re.compile(r"\.(jsonl?|ndjson|csv|tsv|parquet|pq|arrow|gz|zst|bz2|xz|txt)$", re.IGNORECASE)


def looks_like_file(path: str) -> bool:
    """Whether `path` ends in a data file's name (x.jsonl, y.parquet.gz): not a repo id, though it could spell one."""
    return bool(_FILE_NAME.search(path))


def url_problem(key: str, value: str) -> str:
    """The one-line refusal of a config value that is meant as a hub URL but names no file (or glob) in a repo."""
    m = _WEB.match(str(value))
    if m and m["kind"] == "tree":  # a folder: its files may be of several splits; the user says which
        return (f"{key}: {value} is a folder's page; give its files as a glob, e.g. "
                f"hf://datasets/{m['repo']}@{m['rev']}/{unquote(m['path']).rstrip('/')}/train-*.parquet")
    return (f"{key}: {value} is not a hub dataset URL like hf://datasets/org/name/data/train-*.parquet "
            "(hf://datasets/org/name@revision/path pins a branch, tag or commit; a file's page "
            "https://huggingface.co/datasets/org/name/blob/main/path, or a split's in the dataset viewer, "
            "https://huggingface.co/datasets/org/name/viewer/default/train, is one too)")


def _match(snapshot: Path, patterns: list[str]) -> list[Path]:
    """The files of `snapshot` (a cache snapshot dir) the patterns match, sorted by their path in the repo.

    Matched as `snapshot_download(allow_patterns=...)` matches (huggingface_hub's own filter), so what is
    downloaded and what is read are the same files."""
    from huggingface_hub.utils import filter_repo_objects

    return [snapshot / name for name in filter_repo_objects(snapshot_names(snapshot), allow_patterns=patterns)]


def snapshot_names(snapshot: Path) -> list[str]:
    """The paths in the repo of the files a cache snapshot holds, sorted."""
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())


@dataclass(frozen=True)
class Fetched:
    files: HubFiles
    revision: str  # the commit sha
    paths: list[Path]  # the matched files in <cache>/datasets--org--name/snapshots/<sha>/, sorted

    patterns: list[str]  # what was matched: [the URL's pattern], or the files of the split chosen (`Listing`)
    split: str | None = None  # the split chosen, for a URL naming the whole repo

    def pin(self) -> dict:
        pin = {"url": self.files.url, "repo_id": self.files.repo_id, "revision": self.revision,
               "pattern": self.files.pattern, "files": [str(p) for p in self.paths]}
        return pin | ({"subset": self.files.subset} if self.files.subset else {}) | (
            {"split": self.split} if self.split else {})


@dataclass(frozen=True)
class Listing:
    """A whole dataset repo at one commit, for choosing a split's files (`pipeline.data.hub_splits`): every file's
    path in the repo, and its README.md (the dataset card, whose YAML may declare its configs and splits)."""

    revision: str  # the commit sha
    names: list[str]
    readme: str | None


def _snapshot(files: HubFiles, cache: Path | None, local_only: bool, patterns: list[str] | None = None,
              revision: str | None = None) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(files.repo_id, repo_type="dataset", revision=revision or files.revision,
                                  cache_dir=cache, allow_patterns=patterns or [files.pattern],
                                  local_files_only=local_only))


def _own_patterns(files: HubFiles, patterns: list[str] | None) -> list[str]:
    if patterns is None and files.pattern is None:
        raise ValueError(f"{files.url} names the whole repo: choose its split's files first (`listing`)")
    return patterns or [files.pattern]


def cached(files: HubFiles, cache: Path | None = None, patterns: list[str] | None = None,
           revision: str | None = None) -> Fetched | None:
    """The matched files in the cache (the URL's pattern, or `patterns` at `revision`), looked up without the
    network; None when the snapshot is not there or holds none of them."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = _own_patterns(files, patterns)
    try:
        snapshot = _snapshot(files, cache, True, patterns, revision)
    except LocalEntryNotFoundError:
        return None
    paths = _match(snapshot, patterns) if snapshot.is_dir() else []
    return Fetched(files, snapshot.name, paths, patterns) if paths else None


def cached_listing(files: HubFiles, cache: Path | None = None) -> Listing | None:
    """The files of the repo's snapshot in the cache (as far as it was downloaded) and its README, without the
    network; None when no snapshot of that revision is cached."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = _snapshot(files, cache, True, ["README.md"])
    except LocalEntryNotFoundError:
        return None
    if not snapshot.is_dir():
        return None
    readme = snapshot / "README.md"
    return Listing(snapshot.name, snapshot_names(snapshot), readme.read_text(encoding="utf-8") if readme.is_file()
                   else None)


def _online_listing(files: HubFiles, cache: Path | None) -> Listing:
    """The repo's files at the commit its revision points to now, from the hub, and its README (downloaded)."""
    from huggingface_hub import HfApi, hf_hub_download

    api = HfApi()
    sha = api.dataset_info(files.repo_id, revision=files.revision).sha
    names = sorted(api.list_repo_files(files.repo_id, repo_type="dataset", revision=sha))
    readme = None
    if "README.md" in names:
        path = hf_hub_download(files.repo_id, "README.md", repo_type="dataset", revision=sha, cache_dir=cache)
        readme = Path(path).read_text(encoding="utf-8")
    return Listing(sha, names, readme)


def listing(files: HubFiles, cache: Path | None = None) -> Listing:
    """The whole repo at its revision (offline: as far as the cache holds it)."""
    from pipeline.storage.hub import download

    return download(files.url, lambda: _online_listing(files, cache), lambda: cached_listing(files, cache),
                    not_cached_message(files, cache))


def not_cached_message(files: HubFiles, cache: Path | None = None) -> str:
    """One line: the URL, the cache it is not in, and the command that fetches it."""
    from pipeline.storage.hub import cache_dir, offline

    where = cache or cache_dir()
    why = " and HF_HUB_OFFLINE=1 forbids downloading it" if offline() else ""
    return (f"{files.url} is not in the Hugging Face cache {where}{why}: run `{files.download_command(where)}` "
            "on a machine with network access (into that cache), or give a local dataset file")


def fetch(files: HubFiles, cache: Path | None = None, patterns: list[str] | None = None,
          revision: str | None = None) -> Fetched:
    """Download the matched files into the cache (offline: only look them up there); the commit and the files.
    `patterns` at `revision` (a commit): the files chosen for a URL naming the whole repo."""
    from pipeline.storage.hub import download

    patterns = _own_patterns(files, patterns)

    def online() -> Fetched:
        snapshot = _snapshot(files, cache, False, patterns, revision)
        paths = _match(snapshot, patterns) if snapshot.is_dir() else []
        if not paths:
            raise UserError(f"{files.url}: no file of {files.repo_id} at commit {snapshot.name} matches "
                            f"{' '.join(repr(p) for p in patterns)}")
        return Fetched(files, snapshot.name, paths, patterns)

    return download(files.url, online, lambda: cached(files, cache, patterns, revision),
                    not_cached_message(files, cache))


# --- the pin, as every reader sees it -------------------------------------------------------------


def is_pin(path) -> bool:
    """`path` is a pin `fetch-data` wrote (its name ends .hub.json and it holds an object with PIN_KEYS)."""
    path = Path(path)
    if not path.name.endswith(PIN_SUFFIX) or not path.is_file():
        return False
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and all(k in info for k in PIN_KEYS)


def read_pin(path) -> dict:
    """A pin's {url, repo_id, revision, pattern, files}; `is_pin(path)` holds."""
    return json.loads(Path(path).read_text())


def pinned_files(path) -> list[Path] | None:
    """The files a pin lists, in order; None when `path` is no pin."""
    return [Path(p) for p in read_pin(path)["files"]] if is_pin(path) else None


def repo_path(file: Path, revision: str) -> str:
    """A pinned file's path in its repo (``data/train-00001.jsonl``): below its commit's snapshot folder."""
    parts = Path(file).parts
    return "/".join(parts[parts.index(revision) + 1:]) if revision in parts else Path(file).name


def fetch_files(repo_id: str, revision: str, patterns: list[str], cache: Path | None = None) -> Path:
    """More files of a dataset repo at a pinned commit, those `patterns` match (as `hf download --include`),
    downloaded into the cache beside the data; the commit's snapshot folder."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, repo_type="dataset", revision=revision, cache_dir=cache,
                                  allow_patterns=patterns))


def arguments() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m pipeline fetch-data", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="hf://datasets/org/name[@revision]/<path or glob>")
    ap.add_argument("--out", required=True, type=Path, help=f"the pin to write (<name>{PIN_SUFFIX})")
    return ap


def write_pin(url: str, out: Path, choose=None) -> Fetched:
    """Fetch the files `url` matches (offline: find them in the cache) and write their pin to `out`. A URL naming
    the whole repo: `choose(files, listing)` gives the patterns of the files to fetch and the split they are."""
    files = parse(url)
    if files is None:
        raise UserError(url_problem("--url", url))
    if files.pattern is None:
        if choose is None:
            raise UserError(f"{url} names a whole dataset repo: give the file or glob in it")
        found = listing(files)
        patterns, split = choose(files, found)
        got = replace(fetch(files, patterns=patterns, revision=found.revision), split=split)
    else:
        got = fetch(files)
    from pipeline.storage.publish import write_text

    write_text(out, json.dumps(got.pin(), indent=2) + "\n")
    print(f"{files.url}: commit {got.revision}, {len(got.paths)} file(s) in {got.paths[0].parent}")
    return got


def main(argv: list[str] | None = None) -> int:
    """The data files alone (`pipeline.data.hub_images.main`, the command, also fetches their images)."""
    args = arguments().parse_args(argv)
    write_pin(args.url, args.out)
    return 0
