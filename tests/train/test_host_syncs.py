"""The update loop's one host sync: per update one all-reduce and one read of device values; the
ranks' agreement on an alert rides on the next update's all-reduce.

A stage runs in this process on a one-rank gloo process group with the
distributed code paths on (`Dist.enabled` forced true, as for several ranks:
DDP wrapping, the ranks' agreement on alerts and preemption). fp16 on the CPU
takes the GradScaler paths too. Counted from one update's start to the next:
`torch.distributed` collectives (every call), and every read of a tensor's value
(`.item()`, `.tolist()`, `bool()` as in `if tensor:`, `int()`, `float()`) made by
the pipeline's code, the GradScaler, transformers or peft (on a GPU each of
those waits for the device). Not counted: the optimizer's own `.item()` of its
CPU step counters (CPU tensors; the fused GPU optimizer keeps them on the device).
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from kits.train import make_run

# What reads a tensor's value back to the host (on a GPU: waits for the device), and whose reads count:
# ours, the GradScaler's, and the libraries' the forward runs through (transformers' mask builder
# tested `if (position_ids ...).all()` in every forward).
READS = ("item", "tolist", "__bool__", "__int__", "__float__")
READERS = ("pipeline", "torch.amp", "transformers", "peft")
UPDATES = 16
SPIKE = 12  # the loss logged for update 13 is multiplied by 10: a loss-spike alert there


# The trainer runs in this process and installs its preemption handlers: pytest gets its own back.
pytestmark = pytest.mark.usefixtures("own_signal_handlers")


def _counting(monkeypatch, counts: Counter) -> None:
    for name in ("all_reduce", "broadcast", "all_gather", "all_gather_object", "broadcast_object_list", "barrier"):
        real = getattr(dist, name)
        monkeypatch.setattr(dist, name, lambda *a, _real=real, _name=name, **k: (counts.update([_name]),
                                                                                   _real(*a, **k))[1])
    for name in READS:
        real = getattr(torch.Tensor, name)

        def read(self, *a, _real=real, **k):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith(READERS):
                counts.update(["read"])
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, read)


def test_one_all_reduce_and_one_host_read_per_update(tiny, tmp_path, monkeypatch):
    from pipeline import distributed
    from pipeline.train import stage
    from pipeline.train.faults import Hooks

    run = make_run(tmp_path / "run", tiny, total=UPDATES, fraction=0.5, chunks=1, single_stage=True,
                   overrides=["precision.mode=fp16", "checkpoint.save_every=0", "ema.rates=[0.9]",
                              "alerts.tps_drop_fraction=0"])  # no throughput alert on a shared machine
    counts, per_update = Counter(), []
    real_start = Hooks.update_start

    def update_start(self, step):
        per_update.append(dict(counts))
        counts.clear()
        return real_start(self, step)

    monkeypatch.setattr(Hooks, "update_start", update_start)
    monkeypatch.setattr(distributed.Dist, "enabled", property(lambda self: True))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    monkeypatch.setenv("SFT_FAULTS", f'{{"loss_spike_steps": [{SPIKE}]}}')
    try:
        _counting(monkeypatch, counts)
        out = run.stage_dir("all")
        assert stage.main(["--plan", str(run.plan), "--config", str(run.config), "--stage", "all",
                           "--scratch", str(run.scratch("all")), "--out", str(out)]) == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # per_update[k] holds what update k - 1 and the loop after it did ([0] and [1] include set-up; the
    # alert's evaluation and checkpoint come after update 14)
    assert len(per_update) == UPDATES
    assert per_update[2:SPIKE + 2] == [{"all_reduce": 1, "read": 1}] * SPIKE, per_update
    # Raised after update 13 on this rank, agreed in update 14's all-reduce, acted on after it.
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["reason"].split(":")[0]) for r in rows if r.get("event") == "eval"]
    assert evals == [(SPIKE + 2, "alert"), (UPDATES, "end of the run")], evals
