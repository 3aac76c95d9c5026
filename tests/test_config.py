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
])
def test_bad_keys_and_values_name_the_key(override, words):
    with pytest.raises(UserError, match=words.replace(".", r"\.")):
        train_config.resolve(CONF, "config", BASE + [override])


def test_grad_accumulation_is_derived_and_checked():
    cfg = train_config.resolve(CONF, "config", BASE + ["optim.global_batch=32", "optim.micro_batch=4"])
    assert train_config.grad_accum_steps(cfg, 2) == 4
    with pytest.raises(UserError, match="not divisible"):
        train_config.grad_accum_steps(cfg, 3)


def test_resolved_config_round_trips(tmp_path):
    cfg = train_config.resolve(CONF, "config", BASE)
    (tmp_path / "c.yaml").write_text(train_config.to_yaml(cfg))
    assert train_config.load(tmp_path / "c.yaml") == cfg
