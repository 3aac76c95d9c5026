"""`profile.updates`: a stage writes a profiler trace of a window of its updates and a summary of where
the time went, beside its metrics, and trains exactly as without it."""

from __future__ import annotations

import json

import pytest

from kits.train import checkpoint_digests, make_run

from pipeline import layout
from pipeline.train import profiling


def test_a_profiled_stage_writes_the_trace_and_summary_and_trains_the_same_adapter(tiny, tmp_path):
    runs = {}
    for name, extra in (("plain", []), ("profiled", ["profile.updates=2", "profile.warmup=1"])):
        run = make_run(tmp_path / name, tiny, total=4, single_stage=True, overrides=extra)
        runs[name] = (run, run.train("all"))
    run, proc = runs["profiled"]
    profile = run.stage_dir("all") / layout.PROFILE_DIR
    trace = json.loads((profile / layout.PROFILE_TRACE.format(start=1, end=2)).read_text())
    assert trace["traceEvents"]
    summary = json.loads((profile / layout.PROFILE_SUMMARY).read_text())
    assert summary["updates"] == [1, 2] and list(summary["seconds"]) == list(profiling.CATEGORIES)
    # Each category of the tiny LoRA model's update is there: the ops were found under their names.
    for kind in ("matmuls", "attention", "loss", "optimizer", "EMA", "data wait", "other ops"):
        assert summary["seconds"][kind] > 0, kind
    assert abs(sum(summary["share"].values()) - 1) < 1e-9
    assert "[all] profile of updates 1..2" in proc.stdout and "matmuls" in proc.stdout
    assert not (runs["plain"][0].stage_dir("all") / layout.PROFILE_DIR).exists()
    final = [checkpoint_digests(r.stage_dir("all") / layout.STAGE_CHECKPOINT) for r, _ in runs.values()]
    assert final[0] == final[1]  # profiling changes no bit of the adapter, optimizer or EMA


def test_ops_are_counted_under_the_nearest_name_that_says_what_they_are():
    assert profiling.category_of(["aten::mm", "MmBackward0"]) == "matmuls"
    assert profiling.category_of(["aten::mm", "aten::_scaled_dot_product_flash_attention_for_cpu"]) == "matmuls"
    assert profiling.category_of(["aten::copy_", "aten::_scaled_dot_product_flash_attention_for_cpu"]) == "attention"
    assert profiling.category_of(["aten::exp", "aten::_log_softmax", "aten::log_softmax"]) == "loss"
    assert profiling.category_of(["aten::_fused_adamw_", "Optimizer.step#AdamW.step"]) == "optimizer"
    assert profiling.category_of(["aten::lerp_", "EMA"]) == "EMA"
    assert profiling.category_of(["aten::cat", "data wait"]) == "data wait"
    assert profiling.category_of(["aten::add_"]) is None


def test_gpu_time_is_counted_once_under_the_op_that_launched_it():
    """On a GPU the profiler gives each CPU op with its kernels' time attached and each kernel again
    as an event of its own (as torch's Kineto parser builds them); the summary counts that time once."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    def cpu_op(name, start, end, kernel_us):
        op = FunctionEvent(1, name, thread=1, start_us=start, end_us=end, use_device="cuda")
        op.append_kernel(f"{name} kernel", 0, kernel_us)
        kernel = FunctionEvent(1, f"{name} kernel", thread=7, start_us=start, end_us=start + kernel_us,
                               use_device="cuda", device_type=DeviceType.CUDA)
        return [op, kernel]

    events = cpu_op("aten::mm", 0, 10, 300) + cpu_op("aten::_log_softmax", 20, 25, 100)
    summary = profiling.summarize(events, wall_s=0.001, device=True)
    assert summary["seconds"]["matmuls"] == pytest.approx(300e-6)
    assert summary["seconds"]["loss"] == pytest.approx(100e-6)
    assert summary["seconds"]["other ops"] == 0
    assert summary["seconds"]["untraced"] == pytest.approx(600e-6)
