"""LoRA variants in training: DoRA (its magnitude vectors trained, saved, resumed) and LoRA+
(lora_B at lr x ratio), each chunked == one run bitwise."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from kits.train import final_digests, make_run, stage_names, step_losses

from pipeline import layout

TOTAL = 6  # pilot 3 + chunk01 3 (fraction 0.5, one chunk): one resume, three processes in all
DORA_PLUS = ["lora.use_dora=true", "optim.lora_plus_ratio=4"]


def _adapter(ckpt, sub=layout.ADAPTER_DIR) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / sub / layout.PEFT_WEIGHTS))


def test_dora_with_lora_plus_chunked_equals_one_run(tiny, tmp_path):
    one = make_run(tmp_path / "one", tiny, total=TOTAL, fraction=0.5, chunks=1, overrides=DORA_PLUS,
                   single_stage=True)
    one.train("all")
    chunked = make_run(tmp_path / "chunked", tiny, total=TOTAL, fraction=0.5, chunks=1, overrides=DORA_PLUS)
    names = stage_names(chunked)
    assert names == ["pilot", "chunk01"]
    chunked.chain(names)
    # adapter, both EMA shadows and the optimizer state byte for byte, and every update's loss
    digests = final_digests(chunked, "chunk01")
    assert {"adapter/adapter_model.safetensors", "ema/0.9/adapter_model.safetensors",
            "ema/0.99/adapter_model.safetensors", "training_state/optimizer.safetensors"} <= set(digests)
    assert digests == final_digests(one)
    assert step_losses([chunked.stage_dir(s) for s in names]) == step_losses([one.stage_dir("all")])

    ckpt = one.stage_dir("all") / layout.STAGE_CHECKPOINT
    adapter = _adapter(ckpt)
    magnitudes = [k for k in adapter if k.endswith(".lora_magnitude_vector")]
    lora_b = [k for k in adapter if k.endswith(".lora_B.weight")]
    assert magnitudes and len(magnitudes) == len(lora_b)  # one per adapted layer, in the adapter ...
    for tag in ("0.9", "0.99"):  # ... and in every EMA shadow
        assert set(_adapter(ckpt, f"{layout.EMA_DIR}/{tag}")) == set(adapter)
    assert json.loads((ckpt / layout.ADAPTER_DIR / layout.PEFT_CONFIG).read_text())["use_dora"] is True
    # The magnitudes trained (they start at the base rows' norms).
    base = load_file(str(tiny["model"] / "model.safetensors"))
    key = next(k for k in magnitudes if ".q_proj." in k)
    start = base[key.removeprefix("base_model.model.").replace("lora_magnitude_vector", "weight")].norm(dim=1)
    assert not torch.allclose(adapter[key], start)

    # LoRA+: two param groups, the second (every lora_B and magnitude) at 4 x the first's lr.
    meta = json.loads((ckpt / layout.TRAINING_STATE_DIR / "optimizer.json").read_text())
    slow, fast = meta["param_groups"]
    assert fast["lr"] == pytest.approx(4 * slow["lr"]) and fast["initial_lr"] == pytest.approx(4e-3)
    assert all(".lora_A." in n for n in slow["params"])
    assert {n.split(".")[-3] for n in fast["params"]} == {"lora_B", "lora_magnitude_vector"}
