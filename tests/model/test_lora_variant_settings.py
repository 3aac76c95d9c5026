"""LoRA variants at model build and plan time: DoRA and the init reach peft, the start is the
base model, DoRA on a layer kind it does not support fails at plan naming the keys, and LoRA+
picks the parameters that learn faster."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kits.train import resolved_config

from pipeline import config as train_config
from pipeline.errors import UserError
from pipeline.model import loading
from pipeline.model.precision import Precision
from pipeline.planning import plan
from pipeline.train.optimizer import adamw, is_fast

CONF = Path(__file__).resolve().parents[2] / "config" / "train"


def _cfg(model_dir, *overrides: str) -> train_config.TrainConfig:
    return train_config.resolve(CONF, "config", [f"model.path={model_dir}", "tokens.train_cache=/t", *overrides])


def test_dora_with_gaussian_init_starts_at_the_base_model(tiny):
    cfg = _cfg(tiny["model"], "lora.use_dora=true", "lora.init=gaussian", "lora.dropout=0")
    model = loading.build(cfg, Precision("fp32", "cpu"), torch.device("cpu"))
    peft_config = model.peft_config["default"]
    assert peft_config.use_dora is True and peft_config.init_lora_weights == "gaussian"
    params = dict(model.named_parameters())
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    # gaussian: A ~ N(0, 1/r), B zero; DoRA's magnitude starts at the base rows' norms, and is trained
    assert float(params[f"{q}.lora_A.default.weight"].std()) == pytest.approx(1 / cfg.lora.r, rel=0.3)
    assert not params[f"{q}.lora_B.default.weight"].any()
    magnitude = params[f"{q}.lora_magnitude_vector.default.weight"]
    assert magnitude.requires_grad
    torch.testing.assert_close(magnitude, params[f"{q}.base_layer.weight"].norm(dim=1))
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        adapted = model(ids).logits
        with model.disable_adapter():
            base = model(ids).logits
    torch.testing.assert_close(adapted, base)


def test_dora_on_a_layer_kind_it_does_not_support_fails_at_plan_naming_the_keys(tmp_path):
    """Mamba's conv1d is an nn.Conv1d: peft has DoRA for it, the merge (2-D weights) has not."""
    from transformers import MambaConfig, MambaForCausalLM

    model_dir = tmp_path / "mamba"
    MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, state_size=4)).save_pretrained(
        model_dir)
    args = ["--total-updates", "10", "--pilot-fraction", "0.2", "--num-chunks", "1", "--export-weights", "raw",
            "--out-plan", str(tmp_path / "plan.json"), "--out-config", str(tmp_path / "c.yaml")]
    overrides = [f"model.path={model_dir}", "tokens.train_cache=/t", "lora.target_modules=[in_proj,conv1d]"]
    with pytest.raises(UserError) as err:
        plan.main(args + resolved_config([*overrides, "lora.use_dora=true"]))
    message = str(err.value)
    assert "lora.use_dora=true" in message and "lora.target_modules=['in_proj', 'conv1d']" in message
    assert "conv1d (Conv1d)" in message and "in_proj" not in message.split("here:")[1]
    assert not (tmp_path / "plan.json").exists()
    # plain LoRA: peft itself refuses conv1d on a Mamba model, at plan too
    with pytest.raises(UserError, match=r"peft refuses conv1d .* it may take: dt_proj, in_proj, x_proj"):
        plan.main(args + resolved_config([*overrides, "lora.use_dora=false"]))
    # dt_proj, whose weight Mamba's forward reads itself (dt_proj.weight @ x): an adapter there never trains
    overrides[-1] = "lora.target_modules=[in_proj,dt_proj]"
    with pytest.raises(UserError, match=r"mamba's forward in .* reads the weight of dt_proj itself .* never train; "
                                        r"it may take: in_proj, x_proj$"):
        plan.main(args + resolved_config([*overrides, "lora.use_dora=false"]))
    # what peft takes passes the check
    overrides[-1] = "lora.target_modules=[in_proj]"
    assert plan.main(args + resolved_config([*overrides, "lora.use_dora=false"])) == 0


def test_lora_plus_speeds_up_lora_b_and_dora_magnitudes_only(tiny):
    names = ["m.q_proj.lora_A.default.weight", "m.q_proj.lora_B.default.weight",
             "m.q_proj.lora_magnitude_vector.default.weight", "m.embed_tokens.lora_embedding_A.default",
             "m.embed_tokens.lora_embedding_B.default", "m.embed_tokens.token_adapter.trainable_tokens_delta.default",
             "m.projector.modules_to_save.default.weight"]
    assert [n for n in names if is_fast(n)] == names[1:3]

    cfg = _cfg(tiny["model"], "lora.use_dora=true", "optim.lora_plus_ratio=8", "optim.lr=1e-3")
    model = loading.build(cfg, Precision("fp32", "cpu"), torch.device("cpu"))
    named, optimizer = adamw(loading.trainable(model), cfg.optim, torch.device("cpu"))
    slow, fast = optimizer.param_groups
    assert (slow["lr"], fast["lr"]) == (1e-3, 8e-3)
    # `named` lists the parameters in the groups' order: what the checkpoints key their state by
    assert [id(p) for _, p in named] == [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert len(fast["params"]) == 2 * 14 and len(slow["params"]) == 14  # 2 layers x 7 targets

    cfg = _cfg(tiny["model"])  # off: one group, the trained parameters in their own order
    named_off = loading.trainable(loading.build(cfg, Precision("fp32", "cpu"), torch.device("cpu")))
    named, optimizer = adamw(named_off, cfg.optim, torch.device("cpu"))
    assert len(optimizer.param_groups) == 1 and named == named_off
