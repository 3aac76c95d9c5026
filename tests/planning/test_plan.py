"""`python -m pipeline plan`: the stages, the resolved config, and checks across the two configs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kits.train import resolved_config

from pipeline import config as train_config
from pipeline.errors import UserError
from pipeline.planning import checks, plan

CONF = Path(__file__).resolve().parents[2] / "config" / "train"
BASE = ["model.path=/m", "tokens.train_cache=/t.safetensors", "ema.rates=[0.9,0.98]"]


def _plan_args(tmp_path, *extra, overrides: list[str] = ()) -> list[str]:
    """The plan's command line for config/train/ with BASE and `overrides`, as the workflow resolves it."""
    return ["--total-updates", "20", "--pilot-fraction", "0.1", "--num-chunks", "2",
            *resolved_config([*BASE, *overrides]), "--export-weights", "raw",
            "--out-plan", str(tmp_path / "plan.json"), "--out-config", str(tmp_path / "train_config.yaml"), *extra]


def test_plan_writes_the_stages_and_the_resolved_config(tmp_path):
    assert plan.main(_plan_args(tmp_path, "--export-weights", "ema", "--export-ema-rate", "0.98")) == 0
    stages = json.loads((tmp_path / "plan.json").read_text())["stages"]
    assert [(s["name"], s["start"], s["end"]) for s in stages] == [("pilot", 0, 2), ("chunk01", 2, 11),
                                                                  ("chunk02", 11, 20)]
    cfg = train_config.load(tmp_path / "train_config.yaml")
    assert cfg.ema.rates == [0.9, 0.98]
    assert train_config.to_yaml(cfg) == train_config.to_yaml(train_config.resolve(CONF, "config", BASE))


def test_export_rate_not_kept_by_the_trainer_fails_at_plan_naming_both_keys(tmp_path):
    with pytest.raises(UserError) as err:
        plan.main(_plan_args(tmp_path, "--export-weights", "ema", "--export-ema-rate", "0.5"))
    assert "export.ema_rate=0.5" in str(err.value) and "ema.rates=[0.9, 0.98]" in str(err.value)
    assert not (tmp_path / "plan.json").exists()  # nothing is planned from a config that cannot finish


@pytest.mark.parametrize("overrides, workflow, keys", [
    (["ema.rates=[]"], {"export_weights": "ema", "export_ema_rate": None}, ["export.weights=ema", "ema.rates=[]"]),
    ([], {"export_weights": "ema", "export_ema_rate": None}, ["export.weights=ema", "export.ema_rate"]),
    (["optim.global_batch=32", "optim.micro_batch=8"], {"export_weights": "raw", "export_ema_rate": None, "world": 3},
     ["optim.global_batch=32", "cannot be shared by 3 ranks", "optim.micro_batch=8"]),
])
def test_every_cross_config_problem_names_its_keys(overrides, workflow, keys):
    cfg = train_config.resolve(CONF, "config", BASE + overrides)
    problems = checks.cross_check(cfg, **{"world": None, **workflow})
    assert len(problems) == 1 and all(k in problems[0] for k in keys), problems


def test_a_consistent_config_has_no_cross_config_problem():
    cfg = train_config.resolve(CONF, "config", BASE)
    assert checks.cross_check(cfg, export_weights="ema", export_ema_rate=0.98, world=2) == []
    assert checks.cross_check(cfg, export_weights="raw", export_ema_rate=None, world=None) == []


def test_world_size_is_known_when_the_workflow_fixes_it():
    assert checks.world_size(1, "auto", "auto") is None  # one rank per GPU found at run time
    assert checks.world_size(2, 8, "auto") == 16 and checks.world_size(2, "auto", 4) == 8
    assert checks.world_size(1, 0, "auto") == 1  # a CPU node runs one process


LLAMA_8B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5}
LLAMA_1B = {**LLAMA_8B, "hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192,
            "head_dim": 64, "tie_word_embeddings": True}


def _model_dir(tmp_path, config: dict):
    """A model dir with its config.json only: the estimate reads nothing else (no weights)."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_a_run_that_cannot_fit_its_gpus_fails_at_plan_with_the_estimate_and_the_knobs(tmp_path, capsys):
    model = _model_dir(tmp_path, LLAMA_8B)
    args = _plan_args(tmp_path, "--max-length", "2048", overrides=[
        f"model.path={model}", "model.gpu_memory_gb=24", "optim.micro_batch=8", "model.activation_checkpointing=off"])
    with pytest.raises(UserError) as err:
        plan.main(args)
    text = str(err.value)
    assert "the run does not fit" in text and "21.8 GiB usable on model.gpu_memory_gb=24" in text
    for part in ("weights (bf16)", "LoRA weights", "gradients", "optimizer", "EMA shadows", "activations",
                 "loss (one chunk of logits)", "micro-batch 8 x 2048 tokens, activation checkpointing 0 of 32 layers"):
        assert part in text, part
    for knob in ("model.activation_checkpointing=on", "optim.micro_batch=", "distributed=fsdp"):
        assert knob in text, knob
    assert not (tmp_path / "plan.json").exists()


def test_auto_checkpointing_is_what_lets_a_run_fit(tmp_path, capsys):
    model = _model_dir(tmp_path, LLAMA_1B)
    base = [f"model.path={model}", "model.gpu_memory_gb=24", "optim.micro_batch=8"]
    assert plan.main(_plan_args(tmp_path, "--max-length", "2048", overrides=base)) == 0  # auto: 29 GiB without, 7.6 GiB with every layer
    out = capsys.readouterr().out
    # 21.8 GiB usable (24 less 5%, less 1 GiB of CUDA context): each checkpointed layer saves 1.5 GiB
    # (lora.dropout=0, the default: no dropped copy of each adapted layer's input is kept)
    assert "activation_checkpointing=auto: activation checkpointing 5 of 16 layers (the fewest that fit)" in out
    assert "micro-batch 8 x 2048 tokens, activation checkpointing 5 of 16 layers" in out
    with pytest.raises(UserError, match="does not fit"):
        plan.main(_plan_args(tmp_path, "--max-length", "2048", overrides=[*base, "model.activation_checkpointing=off"]))


def test_without_a_gpu_or_a_size_the_estimate_is_only_printed(tmp_path, capsys):
    model = _model_dir(tmp_path, LLAMA_8B)
    assert plan.main(_plan_args(tmp_path, "--max-length", "4096", overrides=[f"model.path={model}"])) == 0
    out = capsys.readouterr().out
    assert "memory per GPU" in out and "not checked" in out


def test_the_workflow_resolution_is_written_as_is_and_its_sha256_is_the_cache_key(tmp_path):
    cfg = train_config.resolve(CONF, "config", BASE + ["optim.lr=1e-3"])
    text = train_config.to_yaml(cfg)
    args = ["--total-updates", "20", "--pilot-fraction", "0.1", "--num-chunks", "2",
            "--resolved-config", text, "--export-weights", "ema", "--export-ema-rate", "0.98",
            "--out-plan", str(tmp_path / "plan.json"), "--out-config", str(tmp_path / "train_config.yaml")]
    assert plan.main(args) == 0
    written = (tmp_path / "train_config.yaml").read_text()
    assert written == text
    assert hashlib.sha256(written.encode()).hexdigest() == train_config.config_id(text)
    with pytest.raises(SystemExit):  # one source of the config: the resolution the workflow hands over
        plan.main(args + ["--train-config-dir", str(CONF)])


@pytest.mark.parametrize("text, why", [
    ("model: {path: /m}\ntokens: {train_cache: /t}\n", "not a resolved trainer config"),  # a part: the rest defaults
    ("[1, 2]\n", "not a trainer config"),
    ("optim: {lr: [\n", "not YAML"),
])
def test_a_text_that_is_not_a_whole_resolved_config_is_refused_before_anything_is_written(tmp_path, text, why):
    args = ["--total-updates", "20", "--pilot-fraction", "0.1", "--num-chunks", "2", "--resolved-config", text,
            "--export-weights", "raw", "--out-plan", str(tmp_path / "plan.json"),
            "--out-config", str(tmp_path / "train_config.yaml")]
    with pytest.raises(UserError, match=why):
        plan.main(args)
    assert not (tmp_path / "plan.json").exists() and not (tmp_path / "train_config.yaml").exists()
