from pathlib import Path

import pytest

from pipeline import config as train_config
from pipeline.errors import UserError

CONF = Path(__file__).resolve().parents[1] / "config" / "train"
BASE = ["model.path=/m", "data.train_cache=/t.safetensors"]


def test_overrides_apply_and_groups_compose():
    cfg = train_config.resolve(CONF, "config", BASE + ["optim.lr=0.1", "ema.rates=[0.5]", "lora=full"])
    assert cfg.optim.lr == 0.1 and cfg.ema.rates == [0.5] and cfg.lora.enabled is False


@pytest.mark.parametrize("override, words", [
    ("optim.lrr=1", "optim.lrr"),
    ("optim.lr=fast", "optim.lr"),
    ("precision.mode=fp8", "precision.mode"),
    ("ema.rates=[1.5]", "ema.rates"),
    ("model.activation_checkpointing=sometimes", "model.activation_checkpointing"),
    ("data.packing=maybe", "data.packing"),
    ("model.attn_implementation=flash", "model.attn_implementation"),
    ("model.gpu_memory_gb=-1", "model.gpu_memory_gb"),
])
def test_bad_keys_and_values_name_the_key(override, words):
    with pytest.raises(UserError, match=words.replace(".", r"\.")):
        train_config.resolve(CONF, "config", BASE + [override])


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
    (tmp_path / "d.yaml").write_text(train_config.to_yaml(cfg).replace(f"packing: {cfg.data.packing}", "packing: on"))
    assert train_config.load(tmp_path / "d.yaml").data.packing == "on"
