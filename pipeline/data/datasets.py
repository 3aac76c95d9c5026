"""The run's datasets as the workflow sees them: one rule family for every training dataset.

A run trains on one or several training datasets (``data.train``: one path, or
a list; `pipeline.workflow_config.train_sets`): one file is a mix of one. Each
dataset is validated and tokenized by the same rules, into
``results/<run>/data/train/<name>/``; a file of ``data.shard_mb`` MiB or more
is split into shards (`pipeline.data.shards`), each validated and tokenized by
a job of its own and merged. The run's ``data/validation.json``,
``validation.csv`` and ``stats.json`` are merged from the datasets' own
(`pipeline.data.mixed_reports`); ``val`` and ``test`` are checked with every
training dataset and tokenized once. A dataset given by hub URL
(`pipeline.storage.hub_data`) is read through the pin `fetch_data` writes; one given
by a glob (`pipeline.storage.globs`) is declared to Snakemake by the files it matches
(`input_files`) and handed to the commands as the glob (`arg`).

`RunData` is what the Snakefile asks: each dataset's path, shards and files,
the data flags every data command takes (built once: `flags`), the inputs of
the rules, and the trainer's overrides for the caches. Light on purpose (no
torch, no record read): the Snakefile imports it at every parse.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pipeline import layout
from pipeline.data import kinds
from pipeline.data.hub_splits import split_of_key
from pipeline.data.shards import DEFAULT_SHARD_MB, shard_count
from pipeline.storage import globs, hub_data
from pipeline.workflow_config import train_sets

SPLITS = ("train", "val", "test")


@dataclass
class TrainSet:
    """One training dataset: its name (a directory and a wildcard value), file, share of the mix, key and role
    names, and the directory its relative image paths start from (None: its file's)."""

    name: str
    path: str
    weight: float | None
    records: int | None
    columns: dict
    roles: dict
    image_dir: str | None = None


class RunData:
    """The data of a run (`config` the validated workflow config; `tree` its `layout.RunTree`; `resolve(value,
    split)` the path of a dataset value: a demo's split for ``embedded``)."""

    def __init__(self, config: Mapping, tree: layout.RunTree, resolve: Callable[[object, str], str | None]):
        data = config["data"]
        self.data, self.tree = data, tree
        entries = train_sets(data) or train_sets({**data, "train": [{"path": data["train"],
                                                                      "name": layout.SINGLE_TRAIN_SET}]})
        self.shard_mb = data.get("shard_mb", DEFAULT_SHARD_MB)
        self.hub: dict[str, str] = {}  # `fetch_data`'s key -> the hub URL it fetches
        self.sets = {}
        for name, entry in entries.items():
            path = self._pinned(resolve(entry["path"], "train"), f"train/{name}")
            self.sets[name] = TrainSet(name, path, entry["weight"], entry["records"], entry["columns"],
                                       entry["roles"], entry["image_dir"])
        self.mixed = isinstance(data["train"], list)  # several datasets (or a list of one): tokens.mix
        self.notes: list[str] = []  # how `resolve` read a path (a folder of several splits: the key's)
        self.held_out = {split: self._pinned(resolve(data[split], split), split) for split in ("val", "test")}

    def _pinned(self, path: str | None, key: str) -> str | None:
        """A dataset given by hub URL is read from its pin (`layout.RunTree.hub_data(key)`, written by `fetch_data`);
        any other path is itself."""
        if not hub_data.is_url(path):
            return path
        self.hub[key] = path
        return str(self.tree.hub_data(key))

    def hub_key(self, dataset: str) -> str | None:
        """The `fetch_data` key of a training dataset given by hub URL; None for a local one."""
        key = f"train/{dataset}"
        return key if key in self.hub else None

    def fetch_flags(self, key: str) -> str:
        """`fetch_data`'s ``--split`` (for a URL naming a whole repo) and the field flags (`field_flags`) for the
        dataset of `key` (it reads the records' image paths): a training dataset's own, else the data settings'."""
        name = key.removeprefix("train/") if key.startswith("train/") else None
        return f"--split {split_of_key(key)} {self.field_flags(name)}".strip()

    def hub_wildcard(self) -> str:
        """The `fetch_data` rule's `key` wildcard: one of the keys of the datasets given by hub URL."""
        return "|".join(re.escape(key) for key in self.hub)

    def split_path(self, split: str) -> str | None:
        """The val / test file, None when the config says null."""
        return self.held_out[split]

    def flags(self, dataset: str | None = None, *, duplicates: bool = True) -> str:
        """The data settings every data command takes (``--max-length --too-long --reasoning [--duplicates]``
        and the dataset's `field_flags`): one place, for every rule."""
        d = self.data
        text = f"--max-length {d['max_length']} --too-long {d['too_long']} --reasoning {d['reasoning']}"
        if duplicates:
            text += f" --duplicates {d['duplicates']}"
        return f"{text} {self.field_flags(dataset)}".strip()

    def field_flags(self, dataset: str | None = None) -> str:
        """`--columns ours=theirs,... --roles theirs=ours,... --image-dir DIR`: data.columns / data.roles /
        data.image_dir, or a training dataset's own on top of them; nothing for what is not set."""
        fields = self.sets[dataset].__dict__ if dataset is not None else self.data
        pairs = lambda mapping: ",".join(f"{k}={v}" for k, v in mapping.items())
        flags = [f"{flag} {shlex.quote(pairs(fields[key]))}" for flag, key in
                 (("--columns", "columns"), ("--roles", "roles")) if fields[key]]
        if fields.get("image_dir"):
            flags.append(f"--image-dir {shlex.quote(str(fields['image_dir']))}")
        return " ".join(flags)

    def held_out_inputs(self) -> dict[str, object]:
        """The val and test files, by split (those the config has)."""
        return {split: input_files(path) for split, path in self.held_out.items() if path}

    def held_out_args(self, present, splits=("val", "test")) -> str:
        """`--val <path> --test <path>`: those of `splits` among `present` (a job's inputs), as given (a glob)."""
        return " ".join(f"--{split} {arg(self.held_out[split])}" for split in splits if present.get(split))

    def shard_total(self, dataset: str) -> int:
        """How many shards a training dataset is split into, by its size on disk now (a hub dataset's: its
        pin's files, known once `fetch_data` has run; the workflow asks after that checkpoint)."""
        return shard_count(self.sets[dataset].path, self.shard_mb)

    def shards(self, dataset: str) -> list[int]:
        """The shard numbers of a dataset, when it is split ([] for one job)."""
        n = self.shard_total(dataset)
        return list(range(n)) if n > 1 else []

    def train_files(self, dataset: str) -> str | list[str]:
        """The files a job reading a training dataset declares (`input_files`)."""
        return input_files(self.sets[dataset].path)

    def train_arg(self, dataset: str) -> str:
        """A training dataset's path as a command's argument (`arg`)."""
        return arg(self.sets[dataset].path)

    def validate_inputs(self, dataset: str) -> dict[str, object]:
        """A training dataset's validation job's inputs: the file, the val / test files it is checked
        with (their overlaps), the run's tokenizer, and its shards' scans when it is split."""
        return {"train": self.train_files(dataset), **self.held_out_inputs(), "tokenizer": self.tree.tokenizer,
                "scans": [self.tree.shard_scan(dataset, k) for k in self.shards(dataset)]}

    def tokenize_inputs(self, dataset: str) -> dict[str, object]:
        """A validated training dataset's tokenization job's inputs: the file, its validation, the copies
        duplicates=drop leaves out, the run's tokenizer, and its shards' parts when it is split."""
        tree = self.tree
        return {"train": self.train_files(dataset), "validation": tree.train_set_validation_json(dataset),
                "dropped": tree.train_set_dropped(dataset), "tokenizer": tree.tokenizer,
                "parts": [tree.shard_part(dataset, k) for k in self.shards(dataset)]}

    def shard_flag(self, dataset: str, shard: str) -> str:
        """`<shard>/<shards>`: a shard job's `--shard`."""
        return f"{shard}/{self.shard_total(dataset)}"

    def train_caches(self) -> list[Path]:
        """Every training dataset's token cache, in the config's order: what the stages read."""
        return [self.tree.train_set_cache(name) for name in self.sets]

    def mix_caches(self) -> list[Path]:
        """The caches the plan counts for the mix (plan.json `mix`): none for one training file."""
        return self.train_caches() if self.mixed else []

    def trainer_overrides(self) -> list[str]:
        """The trainer's cache settings: one file is `tokens.train_cache`; a list is `tokens.mix`
        (`pipeline.data.mix`); and `tokens.val_cache`."""
        if self.mixed:
            entries = []
            for name, s in self.sets.items():
                share = "".join(f",{key}:{value}" for key, value in (("weight", s.weight), ("records", s.records))
                                if value is not None)
                entries.append(f"{{name:{_hydra_str(name)},cache:{_hydra_str(self.tree.train_set_cache(name))}{share}}}")
            own = ["tokens.train_cache=null", f"tokens.mix=[{','.join(entries)}]"]
        else:
            own = [f"tokens.train_cache={self.tree.train_set_cache(next(iter(self.sets)))}"]
        val = self.held_out["val"]
        return own + [f"tokens.val_cache={self.tree.cache('val')}" if val else "tokens.val_cache=null"]

    def wildcard(self) -> str:
        """The `dataset` wildcard's constraint: one of the datasets' names."""
        return "|".join(re.escape(name) for name in self.sets)

    def report_flags(self) -> str:
        """`mixed-reports --dataset name=dir ...`, in the config's order."""
        return " ".join(f"--dataset {name}={self.tree.train_set(name)}" for name in self.sets)


def input_files(path: str) -> str | list[str]:
    """What a job reading the dataset at `path` declares as its input: a glob's data files (so a file added
    or removed reruns it), else `path` itself."""
    try:
        matched = kinds.glob_files(path)
    except kinds.KindError:  # several splits: the job runs and validation names them
        matched = globs.matches(path)
    return path if matched is None else [str(p) for p in matched]


def arg(path: str) -> str:
    """A dataset path as a command's argument: quoted for the shell (a glob reaches the command unexpanded)."""
    return shlex.quote(str(path))


def _hydra_str(text) -> str:
    """`text` as a quoted Hydra string (backslashes and quotes escaped)."""
    escaped = str(text).replace("\\", "\\\\").replace("'", "\\'")
    return f"'{escaped}'"
