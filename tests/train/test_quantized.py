"""A quantized (QLoRA) base trains like a float one: chunked == one run bitwise, only the adapter saved."""

from __future__ import annotations

import pytest
from safetensors import safe_open
from kits.train import final_digests, make_run, stage_names, step_losses

NF4 = ["model.quantization=nf4"]


def _saved_tensors(ckpt) -> dict[str, str]:
    """Every tensor of a checkpoint's weight files (adapter and EMA shadows): key -> dtype."""
    out = {}
    for path in [ckpt / "adapter" / "adapter_model.safetensors", *ckpt.glob("ema/*/adapter_model.safetensors")]:
        with safe_open(str(path), "pt") as f:
            out.update({f"{path.parent.name}:{k}": str(f.get_slice(k).get_dtype()) for k in f.keys()})
    return out


def _chunked_equals_one(tmp_path, tiny, total: int, nproc: int | None = None) -> None:
    chunked = make_run(tmp_path / "chunked", tiny, total=total, fraction=0.34, chunks=1, overrides=NF4)
    names = stage_names(chunked)
    chunked.chain(names, nproc=nproc)
    one = make_run(tmp_path / "one", tiny, total=total, fraction=0.34, chunks=1, overrides=NF4, single_stage=True)
    one.train("all", nproc=nproc)
    digests = final_digests(one)
    assert {"adapter/adapter_model.safetensors", "ema/0.9/adapter_model.safetensors",
            "training_state/optimizer.safetensors"} <= set(digests)
    assert final_digests(chunked, names[-1]) == digests
    assert step_losses([chunked.stage_dir(s) for s in names]) == step_losses([one.stage_dir("all")])
    # The frozen 4-bit base is never written: the checkpoint holds fp32 LoRA tensors only.
    saved = _saved_tensors(one.stage_dir("all") / "checkpoint")
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved), sorted(saved)[:4]
    assert set(saved.values()) == {"F32"}


def test_nf4_chunked_run_equals_one_run(tiny, tmp_path):
    _chunked_equals_one(tmp_path, tiny, total=6)


@pytest.mark.distributed
def test_nf4_ddp_two_ranks_chunked_equals_one_run(tiny, tmp_path):
    _chunked_equals_one(tmp_path, tiny, total=6, nproc=2)
