"""What saving and checking the weights cost in memory: the rank checksum casts chunks, not whole
tensors, to float64; asynchronous DCP saves stage into buffers kept from one save to the next."""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline import distributed
from pipeline.train import fsdp


class _Float64Sizes(TorchDispatchMode):
    """Records the size of every float64 tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                self.sizes.append(t.numel())
        return out


def test_checksum_casts_chunks_not_whole_tensors_to_float64():
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(3 * distributed.CHECKSUM_CHUNK + 5, generator=g),
              torch.randn(64, 32, generator=g).bfloat16()]
    with _Float64Sizes() as seen:
        got = distributed.checksum(params, torch.device("cpu")).tolist()
    assert max(seen.sizes) == distributed.CHECKSUM_CHUNK  # never the 3M-element tensor at once
    want = [sum(float(p.double().sum()) for p in params), sum(float(p.double().abs().sum()) for p in params)]
    assert all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(got, want))
    # The same tensors give the same sums (the ranks compare them exactly).
    assert distributed.checksum([p.clone() for p in params], torch.device("cpu")).tolist() == got


def test_async_saves_stage_into_the_same_buffers_each_time():
    stager = fsdp._reused_stager(torch.device("cpu"))
    weight, moment = torch.randn(256, 16), torch.randn(256, 16)
    state = {"model": {"w": weight}, "optim": {"m": moment}}
    first = stager.stage(state)
    buffers = [first["model"]["w"].data_ptr(), first["optim"]["m"].data_ptr()]
    assert buffers[0] != weight.data_ptr()  # a copy, which the training may change right after
    weight.add_(1.0)  # an update between two saves
    second = stager.stage(state)
    assert [second["model"]["w"].data_ptr(), second["optim"]["m"].data_ptr()] == buffers
    assert torch.equal(second["model"]["w"], weight) and torch.equal(second["optim"]["m"], moment)
    stager.close()
