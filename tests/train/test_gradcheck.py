"""The first update after a restore checks that gradients reach the trained weights."""

from __future__ import annotations

import logging

import pytest
import torch
from kits.train import make_run

from pipeline.errors import UserError
from pipeline.train.gradcheck import check_gradients_flow


@pytest.fixture
def lora_model(tiny):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny["model"]),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    return model, [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _backward(model):
    ids = torch.arange(24).reshape(2, 12) % 50 + 3
    model(input_ids=ids, labels=ids).loss.backward()


def test_restored_adapter_gets_gradients_on_both_lora_halves(lora_model, caplog):
    model, named = lora_model
    with torch.no_grad():  # a trained (restored) adapter: lora_B is no longer zero
        for n, p in named:
            if "lora_B" in n:
                p.normal_(std=0.02)
    _backward(model)
    norm = float(torch.nn.utils.clip_grad_norm_([p for _, p in named], float("inf")))
    with caplog.at_level(logging.INFO, logger="pipeline.train"):
        report = check_gradients_flow(named, norm, "ckpt")
    assert report["with_grad"] == report["trained"] == 8
    assert report["lora_A"] > 0 and report["lora_B"] > 0
    assert "gradient check after restoring from ckpt" in caplog.text and "WARNING" not in caplog.text


def test_zero_lora_b_after_restore_is_a_warning(lora_model, caplog):
    model, named = lora_model  # fresh adapter: lora_B == 0, so lora_A gets no gradient
    _backward(model)
    norm = float(torch.nn.utils.clip_grad_norm_([p for _, p in named], float("inf")))
    report = check_gradients_flow(named, norm, "ckpt")
    assert report["lora_A"] == 0.0 and report["lora_B"] > 0
    assert "lora_A receives no gradient" in caplog.text


@pytest.mark.parametrize("how", ["none", "zero"])
def test_no_gradient_at_all_is_a_user_error(lora_model, how):
    model, named = lora_model
    if how == "zero":
        _backward(model)
        for _, p in named:
            p.grad.zero_()
    with pytest.raises(UserError, match=r"no trained parameter received a gradient .* restoring from ckpt"):
        check_gradients_flow(named, 0.0, "ckpt")


def test_stage_fails_clearly_when_restored_weights_get_no_gradient(tiny, tmp_path):
    run = make_run(tmp_path, tiny, total=4, fraction=0.5, chunks=1)
    run.train("pilot")
    # the first update of chunk01 (global update 2) loses every gradient, as if cut off from the loss
    proc = run.train("chunk01", "pilot", faults={"zero_grad_steps": [2]}, check=False)
    assert proc.returncode == 2
    assert "no trained parameter received a gradient in the first update after restoring from" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run.stage_dir("chunk01").exists()
    proc = run.train("chunk01", "pilot")
    assert "gradient check after restoring from" in proc.stderr
