"""LoRA targets: [all-linear] adapts every Linear / Conv1D layer but the output head, in any causal LM;
targets that match nothing fail at plan, listing what could be adapted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kits.train import resolved_config

from pipeline import config as train_config
from pipeline.planning import plan
from pipeline.errors import UserError
from pipeline.model import loading
from pipeline.model.precision import Precision

CONF = Path(__file__).resolve().parents[2] / "config" / "train"


def _gpt2_dir(root: Path) -> Path:
    """A tiny GPT-2 (Conv1D layers c_attn, c_proj, c_fc; tied lm_head), saved as an HF dir."""
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32)).save_pretrained(root)
    return root


def _cfg(model_dir: Path, *overrides: str) -> train_config.TrainConfig:
    return train_config.resolve(CONF, "config", [f"model.path={model_dir}", "tokens.train_cache=/t", *overrides])


def test_all_linear_adapts_conv1d_layers_and_leaves_the_head(tmp_path):
    cfg = _cfg(_gpt2_dir(tmp_path / "gpt2"))
    assert cfg.lora.target_modules == ["all-linear"]  # the default
    model = loading.build(cfg, Precision("fp32", "cpu"), torch.device("cpu"))
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert adapted == {"c_attn", "c_proj", "c_fc"}
    assert not any("lm_head" in n and "lora" in n for n, _ in model.named_parameters())


def test_all_linear_on_llama_is_the_seven_projections(tiny):
    cfg = _cfg(tiny["model"])
    model = loading.build(cfg, Precision("fp32", "cpu"), torch.device("cpu"))
    assert sorted(model.peft_config["default"].target_modules) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def test_targets_that_match_nothing_fail_at_plan_listing_the_adaptable_layers(tmp_path):
    gpt2 = _gpt2_dir(tmp_path / "gpt2")
    args = ["--total-updates", "10", "--pilot-fraction", "0.2", "--num-chunks", "1",
            *resolved_config([f"model.path={gpt2}", "tokens.train_cache=/t", "lora.target_modules=[q_proj,v_proj]"]),
            "--export-weights", "raw", "--out-plan", str(tmp_path / "plan.json"), "--out-config", str(tmp_path / "c.yaml")]
    with pytest.raises(UserError) as err:
        plan.main(args)
    message = str(err.value)
    assert "lora.target_modules=['q_proj', 'v_proj'] match no layer" in message
    assert "c_attn, c_fc, c_proj" in message and "all-linear" in message
    assert not (tmp_path / "plan.json").exists()
    assert json.loads((gpt2 / "config.json").read_text())["model_type"] == "gpt2"  # the check loads no weights
