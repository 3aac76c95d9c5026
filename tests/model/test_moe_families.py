"""Mixture-of-experts and hybrid families: plan -> one short stage -> consolidate -> merge -> verify.

For each family a tiny random-weight model built from the stock transformers
class (`tests/kits/moe.py`) is saved as a real Hugging Face dir and taken through
the commands the workflow's rules call, in this process (as
tests/model/test_families.py does for dense families): the plan's table of
what LoRA adapts, a stage of two updates (`lora.target_modules: [all-linear]`,
so the experts' fused weights are adapted through peft's `target_parameters`),
the checkpoint's adapter consolidated to a PEFT dir, the streaming merge into
the base's own layout (per-expert tensors for all but GPT-OSS, which stores its
experts fused), and `verify-merge` (merged logits == stock
`PeftModel.from_pretrained(base, adapter)` logits). Stock
`AutoModelForCausalLM.from_pretrained` loads the merged dir (Mistral 4: stock
`AutoModelForImageTextToText`, the one Auto class transformers 5.24 registers its causal LM under).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from kits.moe import EAGER, EXPERT_KEYS, FAMILIES, ROUTER_LOSS, save_family
from kits.train import make_run

from pipeline.errors import UserError
from pipeline.model import exported
from pipeline.model.base import auto_class

UPDATES = 2
MOE_OVERRIDES = ["lora.dropout=0"]  # peft's ParamWrapper (fused experts) takes no dropout

pytestmark = pytest.mark.usefixtures("own_signal_handlers")


def _tensors(root) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(root.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Each family's base dir, saved once for the module."""
    root = tmp_path_factory.mktemp("moe_bases")
    out = {}
    for family in FAMILIES:
        save_family(family, root / family)
        out[family] = root / family
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_merges_and_verifies(family, bases, tiny, tmp_path, capsys):
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.export.card import build_card
    from pipeline.export.consolidate import consolidate
    from pipeline.export.merge import merge_dirs
    from pipeline.export.verify import probe_ids, verify
    from pipeline.train import stage

    layers, fused = FAMILIES[family]
    base = bases[family]
    data = {"model": base, "train": tiny["train"], "val": tiny["val"]}
    run = make_run(tmp_path / "run", data, total=UPDATES, fraction=0.5, chunks=1, single_stage=True,
                   overrides=["optim.lr=1e-2", "optim.warmup_fraction=0", "ema.rates=[]", *MOE_OVERRIDES])
    plan = capsys.readouterr().out
    assert f"attention: {'eager' if family in EAGER else 'sdpa'} (auto:" in plan, plan
    if fused:  # the plan's table names the experts' fused weights as adapted, and the routers as frozen
        experts_line = next(line for line in plan.splitlines() if line.strip().startswith("experts "))
        assert "adapted by" in experts_line and all(name in experts_line for name in fused), plan
        assert "router" in plan and "moe.train_router=true adapts them" in plan, plan
    if family in ("nemotron_h", "falcon_h1"):  # peft 0.19+ refuses Mamba's out_proj there (0.18 takes it)
        refused = _peft_refuses_out_proj(base)
        assert (f"left out: out_proj (mamba): peft refuses it for {family}" in plan) == refused, plan
        layers = layers if refused else layers | {"out_proj"}

    out = run.stage_dir("all")
    assert stage.main(["--plan", str(run.plan), "--config", str(run.config), "--stage", "all",
                       "--scratch", str(run.scratch("all")), "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "loss" in r]
    assert len(updates) == UPDATES and all(math.isfinite(r["loss"]) for r in updates)
    # the router's load-balancing loss, logged on its own, where the model defines one
    assert all(("router_loss" in r) == (family in ROUTER_LOSS) for r in updates), updates
    assert all(r["router_loss"] > 0 for r in updates if "router_loss" in r)

    export = tmp_path / "export"
    consolidate(out / "checkpoint", base, out_adapter=export / "adapter_final", models="main")
    adapter = export / "adapter_final"
    saved = _tensors(adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert set(config.get("target_parameters") or []) >= fused
    if fused:  # the experts' LoRA pairs: one ParamWrapper per fused weight, the second nested in the first
        module, stored = EXPERT_KEYS[family]
        pairs = {f"base_model.model.{module}.{inner}lora_{half}.weight" for inner in ("", "base_layer.")
                 for half in "AB"}
        assert pairs <= set(saved), sorted(saved)
        assert all(saved[k].abs().sum() > 0 for k in pairs if ".lora_B." in k)  # trained, not the zero init
        card = build_card(adapter, run="t", plan={}, stats={}, config={"lora": {"r": 4}}, evals=[])
        assert f"fused weights {', '.join(sorted(config['target_parameters']))} (experts" in card, card  # the card says so
    adapted = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in saved if "experts" not in k}
    assert adapted == {name for name in layers}, sorted(adapted)

    merge_dirs(base, adapter, export / "merged")
    merged_t, base_t = _tensors(export / "merged"), _tensors(base)
    assert set(merged_t) == set(base_t)  # the base's own layout: per-expert tensors stay per expert
    changed = {k for k in merged_t if not torch.equal(merged_t[k], base_t[k])}
    if fused:
        assert stored in changed, sorted(changed)
    if family in ("nemotron_h", "falcon_h1") and "out_proj" not in layers:
        assert not any("out_proj" in k and "mixer" in k or "mamba.out_proj" in k for k in changed)

    report = verify(base, adapter, export / "merged", export / "verification.json", device="cpu")
    assert report["passed"] and report["max_abs_diff"] < 1e-4, report  # fp32 merge: rounding only

    stock = auto_class(AutoConfig.from_pretrained(base))
    assert stock is AutoModelForCausalLM or family == "mistral4"
    merged, info = stock.from_pretrained(export / "merged", output_loading_info=True)
    assert not any(info.values()), info
    original = stock.from_pretrained(base)
    ids = probe_ids(merged.config.vocab_size, 2, 16, seed=0)
    with torch.no_grad():
        moved = (merged(ids).logits - original(ids).logits).abs().max().item()
    assert moved > 100 * max(report["max_abs_diff"], 1e-7), (moved, report["max_abs_diff"])
    # what the chat command, the smoke test's text path and the lm-eval jobs load
    loaded, _ = exported.load(export / "merged")
    assert type(loaded) is type(merged)


def _peft_refuses_out_proj(base) -> bool:
    """Does the peft at hand refuse Mamba's out_proj on this model (its own check, on the meta skeleton)?"""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.compat import peft_refuses_target

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    return peft_refuses_target(model, "out_proj") is not None


def _plan_args(tmp_path, model, *overrides) -> list[str]:
    from kits.train import resolved_config

    args = ["--total-updates", "4", "--pilot-fraction", "0.5", "--num-chunks", "1",
            "--export-weights", "raw", "--out-plan", str(tmp_path / "plan.json"),
            "--out-config", str(tmp_path / "c.yaml")]
    return args + resolved_config([f"model.path={model}", "tokens.train_cache=/t", *overrides])


def test_gpt_oss_with_sdpa_set_fails_at_plan_naming_the_setting(bases, tmp_path):
    from pipeline.planning import plan

    with pytest.raises(UserError) as err:
        plan.main(_plan_args(tmp_path, bases["gpt_oss"], "model.attn_implementation=sdpa", *MOE_OVERRIDES))
    message = str(err.value)
    assert "model.attn_implementation=sdpa: gpt_oss does not support it" in message, message
    assert "it supports flex_attention, eager" in message, message
    assert not (tmp_path / "plan.json").exists()
    assert plan.main(_plan_args(tmp_path, bases["gpt_oss"], "model.attn_implementation=eager", *MOE_OVERRIDES)) == 0


@pytest.mark.parametrize("overrides, words", [
    (["lora.dropout=0.05"], "lora.dropout=0.05: the weights experts.down_proj, experts.gate_up_proj of"),
    (["lora.dropout=0", "lora.use_dora=true"], "lora.use_dora=true: the weights experts.down_proj"),
    (["lora.dropout=0", "lora.target_modules=[gate]"], "names the router(s) gate"),
    (["lora.dropout=0", "lora.target_modules=[w1,w2]"], "lora.target_modules=['w1', 'w2'] match no layer"),
    (["lora.dropout=0", "distributed=fsdp"], "distributed.strategy=fsdp on"),
    (["lora=full"], "lora.enabled=false (full fine-tuning) on"),
])
def test_what_peft_or_the_trainer_would_refuse_fails_at_plan_naming_the_setting(bases, tmp_path, overrides, words):
    from pipeline.planning import plan

    with pytest.raises(UserError) as err:
        plan.main(_plan_args(tmp_path, bases["qwen3_moe"], *overrides))
    assert words in str(err.value), str(err.value)
    if "fsdp" in words:
        assert "lora.target_modules=['all-linear'] adapts their fused weights" in str(err.value)
    assert not (tmp_path / "plan.json").exists()


def test_a_named_list_adapts_the_fused_weights_it_names_and_the_router_on_request(bases, tmp_path, capsys):
    from pipeline.planning import plan

    assert plan.main(_plan_args(tmp_path, bases["qwen3_moe"], "lora.dropout=0",
                                "lora.target_modules=[q_proj,down_proj]", "moe.train_router=true")) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "[experts.down_proj]" in lines["experts"] and "[q_proj]" in lines["attention"], out
    assert "[gate.weight]" in lines["router"] and "adapted by" in lines["router"], out


def test_a_router_that_is_a_linear_with_its_own_forward_trains_through_its_weight(bases, tiny, tmp_path, capsys):
    """Llama 4's router is a Linear subclass whose forward returns (scores, logits): peft's LoRA layer would
    add its output to that tuple. With moe.train_router it is adapted through its weight (a ParamWrapper),
    trains, and merges exactly."""
    from pipeline.export.consolidate import consolidate
    from pipeline.export.merge import merge_dirs
    from pipeline.export.verify import verify
    from pipeline.train import stage

    base = bases["llama4_text"]
    run = make_run(tmp_path / "run", {"model": base, "train": tiny["train"], "val": tiny["val"]}, total=UPDATES,
                   fraction=0.5, chunks=1, single_stage=True,
                   overrides=["optim.lr=1e-2", "optim.warmup_fraction=0", "ema.rates=[]", *MOE_OVERRIDES,
                              "moe.train_router=true"])
    router = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("router "))
    assert "adapted by" in router and "[router.weight]" in router, router
    out = run.stage_dir("all")
    assert stage.main(["--plan", str(run.plan), "--config", str(run.config), "--stage", "all",
                       "--scratch", str(run.scratch("all")), "--out", str(out)]) == 0
    export = tmp_path / "export"
    consolidate(out / "checkpoint", base, out_adapter=export / "adapter", models="main")
    assert "router.weight" in json.loads((export / "adapter" / "adapter_config.json").read_text())["target_parameters"]
    merge_dirs(base, export / "adapter", export / "merged")
    key = "model.layers.0.feed_forward.router.weight"
    assert not torch.equal(_tensors(export / "merged")[key], _tensors(base)[key])  # the router itself moved
    report = verify(base, export / "adapter", export / "merged", export / "verification.json", device="cpu")
    assert report["passed"] and report["max_abs_diff"] < 1e-4, report


def test_a_shared_experts_layers_are_adapted_whatever_peft_does_with_their_names(bases):
    """peft 0.19+ moves the transformers-4 expert names (gate_proj, up_proj, down_proj) of Qwen2-MoE-pattern
    families onto the fused experts (alone, gate_proj even fails there); Qwen3-Next's shared expert has
    Linear layers of those names, which must still be what a list naming them adapts, and nothing else."""
    from kits.train import REPO

    from pipeline import config as train_config
    from pipeline.model import loading, targets
    from pipeline.model.base import meta_model
    from pipeline.model.precision import Precision

    cfg = train_config.resolve(REPO / "config/train", "config", [
        f"model.path={bases['qwen3_next']}", "tokens.train_cache=/t", "lora.target_modules=[q_proj,gate_proj]"])
    planned = targets.resolve(meta_model(cfg.model), cfg.lora, cfg.moe)
    model = loading.build(cfg, Precision("fp32", "cpu"), torch.device("cpu"))
    trained = [n for n, _ in loading.trainable(model)]
    assert sum(p.numel() for _, p in loading.trainable(model)) == planned.lora_params
    assert {n.split(".lora_")[0].split("layers.0.")[-1] for n in trained if "layers.0." in n} == {
        "mlp.shared_expert.gate_proj"}  # layer 0 is linear attention: no q_proj there
    assert not any("experts." in n and "shared_expert" not in n for n in trained)


def test_a_list_that_names_fused_weights_alone_adapts_them_alone(bases):
    """Mixtral's experts named alone: the weights go to peft's target_parameters with no layer in target_modules.
    Given None there, peft 0.18 adapted the family's default layers besides (q_proj and v_proj); the trained
    parameters are the experts' LoRA pairs, as many as the plan counts."""
    from kits.train import REPO

    from pipeline import config as train_config
    from pipeline.model import loading, targets
    from pipeline.model.base import meta_model
    from pipeline.model.precision import Precision

    cfg = train_config.resolve(REPO / "config/train", "config", [
        f"model.path={bases['mixtral']}", "tokens.train_cache=/t", "lora.dropout=0", "lora.target_modules=[down_proj]"])
    planned = targets.resolve(meta_model(cfg.model), cfg.lora, cfg.moe)
    assert planned.modules == [] and planned.parameters == ["experts.down_proj"]
    model = loading.build(cfg, Precision("fp32", "cpu"), torch.device("cpu"))
    trained = [n for n, _ in loading.trainable(model)]
    assert {n.split(".lora_")[0].split("layers.0.")[-1] for n in trained if "layers.0." in n} == {"mlp.experts"}
    assert sum(p.numel() for _, p in loading.trainable(model)) == planned.lora_params
