"""A Hugging Face hub cache laid out as `hf download` leaves it, built from a local model (or dataset) dir.

    <cache>/models--org--name/blobs/<sha256 of the file>           (a dataset repo: datasets--org--name/)
    <cache>/models--org--name/refs/main                      the commit sha
    <cache>/models--org--name/snapshots/<sha>/<file>  ->  ../../blobs/<sha256>   (relative symlinks)
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def commit_of(model_dir: Path) -> str:
    """A stable 40-hex "commit sha" for the dir's content."""
    digest = hashlib.sha1()
    for p in sorted(model_dir.rglob("*")):
        if p.is_file():
            digest.update(p.relative_to(model_dir).as_posix().encode() + b"\0" + p.read_bytes())
    return digest.hexdigest()


def add_to_cache(cache: Path, repo_id: str, model_dir: Path, *, ref: str = "main", commit: str | None = None,
                 repo_type: str = "model") -> Path:
    """Put `model_dir`'s files into `cache` as snapshot `commit` of `repo_id` (a `repo_type` repo: model or
    dataset), `ref` pointing at it; its path."""
    commit = commit or commit_of(model_dir)
    repo = cache / (f"{repo_type}s--" + repo_id.replace("/", "--"))
    blobs, snap = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    for src in sorted(model_dir.rglob("*")):
        if not src.is_file():
            continue
        data = src.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        link = snap / src.relative_to(model_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snap


def write_parquet_shards(repo_dir: Path, records: list[dict], shards: int, pattern: str = "data/train-{:05d}.parquet"
                         ) -> list[Path]:
    """`records` split into `shards` Parquet files under `repo_dir` (as a dataset repo holds them), in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    size = -(-len(records) // shards)
    paths = []
    for k in range(shards):
        path = repo_dir / pattern.format(k)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(records[k * size:(k + 1) * size]), path)
        paths.append(path)
    return paths
