"""The export commands' write guards: inputs are read-only, outputs appear whole or not at all."""

from __future__ import annotations

import pytest

from pipeline.errors import UserError
from pipeline.export.outputs import refuse_overlaps, staged_dir


def test_refuse_overlaps(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    refuse_overlaps({"--out": tmp_path / "out"}, {"--base": base})  # siblings are fine
    refuse_overlaps({"--out": tmp_path / "base2"}, {"--base": base})  # a shared name prefix is not nesting
    for out in (base, base / "x", base / "x" / "y", tmp_path):
        with pytest.raises(UserError, match="overlaps --base"):
            refuse_overlaps({"--out": out}, {"--base": base})
    with pytest.raises(UserError, match="overlap; give separate dirs"):
        refuse_overlaps({"--a": tmp_path / "o", "--b": tmp_path / "o" / "p"}, {"--base": base})


def test_staged_dir_leaves_nothing_on_failure(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with staged_dir(out, overwrite=False) as stage:
            (stage / "partial.safetensors").write_bytes(b"x")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
