"""Fixtures of the export tests; the builders live in export_helpers.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from export_helpers import SMALL_SHARD, save_adapter, save_base


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    """Factory: (base dir, adapter dir) for a tiny Llama, cached per (tied, shard)."""
    cache: dict[tuple, tuple[Path, Path]] = {}

    def make(*, tied: bool = False, shard: str | None = SMALL_SHARD, dtype=torch.float32):
        key = (tied, shard, dtype)
        if key not in cache:
            root = tmp_path_factory.mktemp("pair")
            model = save_base(root / "base", tied=tied, shard=shard, dtype=dtype)
            save_adapter(model, root / "adapter")
            cache[key] = (root / "base", root / "adapter")
        return cache[key]

    return make
