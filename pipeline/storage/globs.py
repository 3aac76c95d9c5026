"""A dataset given as a local glob (``data/train-*.parquet``, ``shards/**/*.jsonl``): the files it matches.

A path is a glob when it holds one of ``* ? [`` and nothing of that very name exists (a file
named ``a[1].jsonl`` is that file). ``**`` matches at any depth, as in `glob.glob` with
``recursive=True``; ``~`` is the home directory. Which of the matches are data, and in which
order they are read, is `pipeline.data.kinds.glob_files`; the workflow's inputs are the matches
(`pipeline.data.datasets`), so a shard added or removed reruns what read the dataset.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

_GLOB_CHARS = frozenset("*?[")


def is_glob(path: str | Path) -> bool:
    """Whether `path` is a glob: it holds one of ``* ? [`` and nothing of that very name exists."""
    text = os.path.expanduser(str(path))
    return bool(_GLOB_CHARS.intersection(text)) and not Path(text).exists()


def root(path: str | Path) -> Path:
    """The directory a glob's matches are named from: its leading parts that hold no glob character."""
    parts = Path(os.path.expanduser(str(path))).parts
    fixed = next((i for i, part in enumerate(parts) if _GLOB_CHARS.intersection(part)), len(parts))
    return Path(*parts[:fixed]) if fixed else Path(".")


def matches(path: str | Path) -> list[Path]:
    """The files (not directories) the glob `path` matches, in no particular order."""
    return [Path(p) for p in glob.glob(os.path.expanduser(str(path)), recursive=True) if os.path.isfile(p)]
