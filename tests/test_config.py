import re
import shutil
from pathlib import Path

import pytest

from pipeline import config as train_config
from pipeline.errors import UserError

CONF = Path(__file__).resolve().parents[1] / "config" / "train"
BASE = ["model.path=/m", "tokens.train_cache=/t.safetensors"]


def test_overrides_apply_and_groups_compose():
    cfg = train_config.resolve(CONF, "config", BASE + ["optim.lr=0.1", "ema.rates=[0.5]", "lora=full"])
    assert cfg.optim.lr == 0.1 and cfg.ema.rates == [0.5] and cfg.lora.enabled is False


@pytest.mark.parametrize("override, words", [
    ("optim.lrr=1", "optim.lrr"),
    ("optim.lr=fast", "optim.lr"),
    ("precision.mode=fp8", "precision.mode: Invalid value 'fp8', expected one of [auto, bf16, fp16, fp32]"),
    ("model.dtype=fp64", "model.dtype: Invalid value 'fp64', expected one of [auto, fp32, bf16, fp16]"),
    ("distributed.strategy=zero3", "distributed.strategy: Invalid value 'zero3', expected one of [ddp, fsdp]"),
    ("ema.rates=[1.5]", "ema.rates"),
    ("model.activation_checkpointing=sometimes",
     "model.activation_checkpointing: Invalid value 'sometimes', expected one of [auto, on, off]"),
    ("tokens.packing=maybe", "tokens.packing: Invalid value 'maybe', expected one of [auto, on, off]"),
    ("model.attn_implementation=flash", "model.attn_implementation: Invalid value 'flash', expected one of "
                                        "[auto, sdpa, eager, flash_attention_2, flash_attention_3, flex_attention]"),
    ("model.gpu_memory_gb=-1", "model.gpu_memory_gb"),
    ("validation.batch_size=0", "validation.batch_size must be positive"),
    ("validation.max_records=0", "validation.max_records must be positive (or null: all)"),
    ("lora.init=pissa", "lora.init='pissa' is not supported: it rewrites the base weights"),
    ("lora.init=pissa_niter_4", "lora.init='pissa_niter_4' is not supported: it rewrites the base weights"),
    ("lora.init=olora", "lora.init='olora' is not supported: it rewrites the base weights"),
    ("lora.init=eva", "lora.init='eva' is not supported: it is data-driven"),
    ("lora.init=kaiming", "lora.init='kaiming' is not one of default, gaussian"),
    ("optim.lora_plus_ratio=0", "optim.lora_plus_ratio=0.0 must be positive"),
])
def test_bad_keys_and_values_name_the_key(override, words):
    with pytest.raises(UserError, match=re.escape(words)):
        train_config.resolve(CONF, "config", BASE + [override])


def test_choices_are_enums_that_compare_and_print_as_strings(tmp_path):
    cfg = train_config.resolve(CONF, "config", BASE + ["precision.mode=bf16", "distributed=fsdp"])
    assert isinstance(cfg.precision.mode, train_config.PrecisionMode) and cfg.precision.mode == "bf16"
    assert f"{cfg.precision.mode}/{cfg.distributed.strategy}" == "bf16/fsdp"
    (tmp_path / "c.yaml").write_text(train_config.to_yaml(cfg))
    again = train_config.load(tmp_path / "c.yaml")
    assert again == cfg and again.distributed.strategy is train_config.Strategy.fsdp


@pytest.mark.parametrize("old, new", [("eval.eval_every=50", "validation.every"),
                                      ("eval.micro_batch=4", "validation.batch_size"),
                                      ("eval.quick_every=3", "validation.quick_every"),
                                      ("data.packing=on", "tokens.packing"),
                                      ("+data.val_cache=/v", "tokens.val_cache"),
                                      ("eval=default", "validation")])
def test_an_old_name_gets_its_new_one_before_hydra_fails(old, new):
    key = old.lstrip("+").split("=")[0]
    with pytest.raises(UserError, match=f"trainer key {re.escape(key)} is now {re.escape(new)}") as err:
        train_config.resolve(CONF, "config", BASE + [old])
    assert "Could not override" not in str(err.value)  # ours, not Hydra's "no such key"


def test_a_resolved_config_with_the_old_group_names_says_the_new_ones(tmp_path):
    text = train_config.to_yaml(train_config.resolve(CONF, "config", BASE))
    (tmp_path / "c.yaml").write_text(text.replace("validation:", "eval:").replace("  every:", "  eval_every:"))
    with pytest.raises(UserError, match=r"eval\.eval_every is now validation\.every"):
        train_config.load(tmp_path / "c.yaml")


def test_micro_batches_are_derived_for_every_world_size():
    cfg = train_config.resolve(CONF, "config", BASE + ["optim.global_batch=32", "optim.micro_batch=16"])
    assert [train_config.batch_split(cfg, w) for w in (1, 2, 4, 8, 32)] == [(16, 2), (16, 1), (8, 1), (4, 1), (1, 1)]
    cfg = train_config.resolve(CONF, "config", BASE + ["optim.global_batch=24", "optim.micro_batch=5"])
    assert train_config.batch_split(cfg, 2) == (4, 3)  # the largest divisor of a rank's 12 that is <= 5
    with pytest.raises(UserError, match=r"optim.global_batch=24 cannot be shared by 5 ranks.*optim.micro_batch=5"):
        train_config.batch_split(cfg, 5)


def test_resolved_config_round_trips(tmp_path):
    cfg = train_config.resolve(CONF, "config", BASE)
    (tmp_path / "c.yaml").write_text(train_config.to_yaml(cfg))
    assert train_config.load(tmp_path / "c.yaml") == cfg


@pytest.mark.parametrize("value, expected", [("on", "on"), ("off", "off"), ("true", "on"), ("false", "off"),
                                             ("auto", "auto")])
def test_on_off_switches_survive_yaml_booleans(tmp_path, value, expected):
    # YAML reads a bare on/off as a boolean: the switch must still mean what was written, and round-trip.
    cfg = train_config.resolve(CONF, "config", BASE + [f"model.activation_checkpointing={value}"])
    assert cfg.model.activation_checkpointing == expected
    (tmp_path / "c.yaml").write_text(train_config.to_yaml(cfg))
    assert train_config.load(tmp_path / "c.yaml") == cfg
    (tmp_path / "d.yaml").write_text(train_config.to_yaml(cfg).replace(f"packing: {cfg.tokens.packing}", "packing: on"))
    assert train_config.load(tmp_path / "d.yaml").tokens.packing == "on"


def test_a_bare_on_in_a_group_file_is_the_switch_on(tmp_path):
    # YAML reads `packing: on` as true: an option file (or a sweep grid [on, off]) must still work.
    tree = shutil.copytree(CONF, tmp_path / "train")
    (tree / "tokens" / "packed.yaml").write_text("packing: on\n")
    cfg = train_config.resolve(tree, "config", BASE + ["tokens=packed", "model.activation_checkpointing=false"])
    assert cfg.tokens.packing is train_config.Switch.on and cfg.model.activation_checkpointing == "off"


@pytest.mark.parametrize("overrides, words", [
    (["distributed=fsdp", "lora.use_dora=true"],
     "lora.use_dora=true with distributed.strategy=fsdp is not supported"),
    (["lora=full", "optim.lora_plus_ratio=4"], "optim.lora_plus_ratio is a LoRA setting, but lora.enabled=false"),
])
def test_lora_variants_that_do_not_combine_name_both_keys(overrides, words):
    with pytest.raises(UserError, match=re.escape(words)):
        train_config.resolve(CONF, "config", BASE + overrides)


def test_lora_variant_settings_resolve():
    cfg = train_config.resolve(CONF, "config", BASE + ["lora.use_dora=true", "lora.init=gaussian",
                                                       "optim.lora_plus_ratio=16"])
    assert (cfg.lora.use_dora, cfg.lora.init, cfg.optim.lora_plus_ratio) == (True, "gaussian", 16.0)
    default = train_config.resolve(CONF, "config", BASE)
    assert (default.lora.use_dora, default.lora.init, default.optim.lora_plus_ratio) == (False, "default", None)
    # full fine-tuning ignores lora.*: a leftover init is not an error there
    assert not train_config.resolve(CONF, "config", BASE + ["lora=full", "lora.init=pissa"]).lora.enabled
