"""Streaming safetensors writer, checked casts and shard planning."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from pipeline.errors import UserError
from pipeline.storage import hf_dir
from pipeline.storage.safetensors_stream import StreamingWriter, TensorSpec, read_specs


def _specs(tensors):
    return [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]


def test_streaming_writer_roundtrips_through_safetensors(tmp_path):
    tensors = {
        "b.bf16": torch.randn(3, 5).to(torch.bfloat16),
        "a.f32": torch.randn(7),
        "c.i64": torch.arange(6).reshape(2, 3),
        "d.bool": torch.tensor([True, False, True]),
        "e.empty": torch.zeros(0, 4, dtype=torch.float16),
        "f.scalar": torch.tensor(2.5),
        "g.noncontiguous": torch.randn(4, 6).T,
    }
    path = tmp_path / "x.safetensors"
    with StreamingWriter(path, _specs(tensors), {"format": "pt"}) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    assert {s.name: s.shape for s in read_specs(path)} == {k: tuple(v.shape) for k, v in tensors.items()}


def test_streaming_writer_refuses_wrong_order_and_missing_tensors(tmp_path):
    tensors = {"a": torch.zeros(2), "b": torch.ones(3)}
    path = tmp_path / "x.safetensors"
    with pytest.raises(ValueError, match="expected tensor 'a'"):
        with StreamingWriter(path, _specs(tensors)) as writer:
            writer.write("b", tensors["b"])
    assert not path.exists()  # no truncated file left behind
    with pytest.raises(ValueError, match="never written"):
        with StreamingWriter(path, _specs(tensors)) as writer:
            writer.write("a", tensors["a"])
    assert not path.exists()
    with pytest.raises(ValueError, match="header says"):
        with StreamingWriter(path, _specs(tensors)) as writer:
            writer.write("a", tensors["a"].double())


def test_cast_checked_refuses_overflow_and_nan():
    assert hf_dir.cast_checked(torch.tensor([1e4, -1e4]), torch.float16, "w").dtype == torch.float16
    for bad in (torch.tensor([1e6]), torch.tensor([float("nan")]), torch.tensor([-float("inf")])):
        with pytest.raises(UserError, match="not finite in torch.float16"):
            hf_dir.cast_checked(bad, torch.float16, "w")
    ids = torch.arange(3)
    assert hf_dir.cast_checked(ids, torch.int64, "ids") is ids


def test_plan_shards_and_sizes():
    specs = [TensorSpec(str(i), torch.float32, (n,)) for i, n in enumerate([10, 10, 30, 5, 5])]
    groups = hf_dir.plan_shards(specs, max_bytes=80)
    assert [[s.name for s in g] for g in groups] == [["0", "1"], ["2"], ["3", "4"]]
    assert hf_dir.parse_size("5GB") == 5 * 10**9 and hf_dir.parse_size("2MiB") == 2 * 2**20
    with pytest.raises(UserError):
        hf_dir.parse_size("lots")
