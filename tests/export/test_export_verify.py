"""`python -m pipeline verify-merge`: passes a correct merge, fails a corrupted one."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from export_helpers import tree_digest
from pipeline import cli
from pipeline.export.merge import merge_dirs
from pipeline.export.verify import probe_ids


@pytest.fixture(scope="module")
def merged_pair(llama_pair, tmp_path_factory):
    base, adapter = llama_pair(tied=True)
    merged = tmp_path_factory.mktemp("verify") / "merged"
    merge_dirs(base, adapter, merged)
    return base, adapter, merged


def _verify(base, adapter, merged, out, *extra):
    return cli.main(["verify-merge", "--base", str(base), "--adapter", str(adapter), "--merged", str(merged),
                     "--out", str(out), *extra])


def test_correct_merge_passes(merged_pair, tmp_path):
    base, adapter, merged = merged_pair
    out = tmp_path / "verification.json"
    assert _verify(base, adapter, merged, out) == 0
    report = json.loads(out.read_text())
    assert report["passed"] is True
    assert report["max_abs_diff"] <= report["tolerance"]
    assert report["tolerance"] == pytest.approx(1e-4 * max(1.0, report["logit_scale"]))
    assert report["merged_dtype"] == "float32" and report["probes"] == 4


def test_bf16_merge_passes_with_auto_tolerance(merged_pair, tmp_path):
    base, adapter, _ = merged_pair
    merged = tmp_path / "merged_bf16"
    merge_dirs(base, adapter, merged, dtype="bf16")
    out = tmp_path / "verification.json"
    assert _verify(base, adapter, merged, out) == 0
    report = json.loads(out.read_text())
    assert report["merged_dtype"] == "bfloat16" and report["relative_tolerance"] == 5e-2
    assert report["max_abs_diff"] > 0  # rounding is visible, and tolerated


def test_corrupted_merge_fails(merged_pair, tmp_path, capsys):
    base, adapter, good = merged_pair
    merged = tmp_path / "corrupted"
    shutil.copytree(good, merged)
    name = "model.layers.1.mlp.down_proj.weight"
    for file in merged.glob("*.safetensors"):
        tensors = load_file(str(file))
        if name in tensors:
            tensors[name][0, :8] += 0.05  # a small slip in one row of one merged weight
            save_file(tensors, str(file), metadata={"format": "pt"})
    out = tmp_path / "verification.json"
    assert _verify(base, adapter, merged, out) == 1
    report = json.loads(out.read_text())
    assert report["passed"] is False and report["max_abs_diff"] > report["tolerance"]
    assert "FAILED" in capsys.readouterr().err


def test_report_inside_base_is_refused(merged_pair):
    base, adapter, merged = merged_pair
    before = tree_digest(base)
    assert _verify(base, adapter, merged, base / "verification.json") == 2
    assert tree_digest(base) == before


def test_probe_ids_are_reproducible_and_in_vocab():
    ids = probe_ids(57, 4, 32, seed=0)
    assert torch.equal(ids, probe_ids(57, 4, 32, seed=0))
    assert ids.min() >= 0 and ids.max() < 57 and ids.shape == (4, 32)
