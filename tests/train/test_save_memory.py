"""What saving and checking the weights cost in memory: the rank checksum casts chunks, not whole
tensors, to float64; asynchronous DCP saves stage into buffers kept from one save to the next."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline import compat, distributed
from pipeline.train import fsdp
from test_compat import torch_2_11_stager  # noqa: F401 (a fixture)


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
    """Each save asks `for_save`, as the trainer does; where a stager can be reused (not torch 2.11's) the
    second save's copies land in the first one's buffers."""
    stagers = compat.SaveStagers(torch.device("cpu"))
    weight, moment = torch.randn(256, 16), torch.randn(256, 16)
    state = {"model": {"w": weight}, "optim": {"m": moment}}
    first = stagers.for_save().stage(state)
    buffers = [first["model"]["w"].data_ptr(), first["optim"]["m"].data_ptr()]
    assert buffers[0] != weight.data_ptr()  # a copy, which the training may change right after
    weight.add_(1.0)  # an update between two saves
    second = stagers.for_save().stage(state)
    if compat.stager_reusable():
        assert [second["model"]["w"].data_ptr(), second["optim"]["m"].data_ptr()] == buffers
    assert torch.equal(second["model"]["w"], weight) and torch.equal(second["optim"]["m"], moment)
    stagers.close()


@pytest.mark.parametrize("torch_2_11", [False, True])
def test_an_fsdp_stage_saves_asynchronously_twice(request, tmp_path, monkeypatch, torch_2_11):
    """Two asynchronous DCP saves of one FSDP strategy (one gloo rank, in this process), also where one
    DefaultStager cannot stage twice (torch 2.11, emulated: the second save failed there); each save
    holds the weights of its moment."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    from pipeline import config as train_config
    from pipeline.train.ema import EMA
    from pipeline.train.parts import TrainingParts

    if torch_2_11:
        request.getfixturevalue("torch_2_11_stager")
    cfg = train_config.to_typed({"model": {"path": "m"}, "tokens": {"train_cache": "t"}})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        fully_shard(model, mesh=fsdp._mesh(distributed.Dist(0, 0, 1, torch.device("cpu")), False))
        named = list(model.named_parameters())
        optimizer = torch.optim.AdamW([p for _, p in named], lr=0.1)
        parts = TrainingParts(model, named, EMA(fsdp._local_named(named), [0.9]), optimizer, None, None)
        strategy = fsdp.FSDP(distributed.Dist(0, 0, 1, torch.device("cpu")), cfg)
        saved = []
        for k in range(2):
            model(torch.ones(2, 8)).sum().backward()
            optimizer.step()
            state = strategy.capture(parts, tmp_path / f"save{k}")
            saved.append(fsdp._local(named[0][1]).detach().clone())
            state.pending.result()
        for k in range(2):
            back = {"model": {"0.weight": torch.empty(8, 8)}}
            dcp.load(back, checkpoint_id=str(tmp_path / f"save{k}"))
            assert torch.equal(back["model"]["0.weight"], saved[k])
        assert not torch.equal(saved[0], saved[1])
    finally:
        dist.destroy_process_group()
