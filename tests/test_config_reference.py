"""One source per trainer setting: docs/train_config.yaml is generated from the dataclasses, and
config/train's group files hold only what an option changes."""

import dataclasses
import shutil
from pathlib import Path

import pytest
import yaml

from pipeline import config as train_config
from pipeline import config_reference as ref
from pipeline.errors import UserError

CONF = Path(__file__).resolve().parents[1] / "config" / "train"


def test_the_committed_reference_is_what_the_dataclasses_generate():
    committed = ref.REFERENCE.read_text() if ref.REFERENCE.is_file() else ""
    assert committed == ref.reference(CONF), (
        f"{ref.REFERENCE} is out of date with pipeline/config.py: run `{ref.COMMAND}` and commit it")


def test_the_reference_carries_a_changed_default_and_every_key(monkeypatch):
    lr = next(f for f in dataclasses.fields(train_config.OptimConfig) if f.name == "lr")
    monkeypatch.setattr(lr, "default", 0.125)
    text = ref.reference(CONF)
    assert "  lr: 0.125\n" in text and text != ref.REFERENCE.read_text()
    # Every key of the schema is there, with its default: the text loads back as the defaults.
    loaded = yaml.safe_load(text)
    expected = train_config.TrainConfig()
    for group in ("optim", "validation", "tokens", "precision"):
        for key, value, _ in ref.defaults(type(getattr(expected, group))):
            want = 0.125 if (group, key) == ("optim", "lr") else ref._enum_value(value)
            assert loaded[group][key] == want, (group, key)
    assert loaded["seed"] == 0 and loaded["tokens"]["packing"] == "auto"


def test_the_reference_names_each_choice_and_each_option():
    text = ref.reference(CONF)
    assert "  # one of: auto | bf16 | fp16 | fp32\n  mode: auto\n" in text
    assert "Options (config/train/lora/): default, full." in text


def test_the_real_group_files_state_no_default():
    assert ref.group_problems(CONF) == []
    # ... and compose to the dataclass defaults, except what an option changes.
    base = ["model.path=/m", "tokens.train_cache=/t"]
    cfg = train_config.resolve(CONF, "config", base)
    assert cfg.lora == train_config.LoraConfig() and cfg.optim == train_config.OptimConfig()
    full = train_config.resolve(CONF, "config", base + ["lora=full", "distributed=fsdp"])
    assert (full.lora.enabled, full.lora.dropout, full.lora.r) == (False, 0.0, 16)
    assert full.distributed.strategy == "fsdp" and full.distributed.timeout_s == 1800


def test_a_group_file_that_restates_a_default_fails_the_check(tmp_path):
    tree = shutil.copytree(CONF, tmp_path / "train")
    (tree / "optim" / "adamw.yaml").write_text("lr: 1.0e-3\nweight_decay: 0.0\n")  # the default option
    (tree / "lora" / "full.yaml").write_text("enabled: false\nr: 16\n")  # r restated
    (tree / "tokens" / "packed.yaml").write_text("packing: on\n")  # a bare on is a change, not a default
    (tree / "eval").mkdir()
    problems = ref.group_problems(tree)
    assert len(problems) == 4, problems
    adamw, wd, full, old = (next(p for p in problems if words in p) for words in
                            ("adamw.yaml: lr", "adamw.yaml: weight_decay", "full.yaml: r", "eval/"))
    assert "differs from the default 0.0002 (OptimConfig.lr in pipeline/config.py)" in adamw
    assert "restates the default" in wd and "restates the default" in full and "unchanged" in full
    assert "renamed: validation" in old
    with pytest.raises(UserError, match="adamw.yaml: lr"):
        ref.main(["--out", str(ref.REFERENCE), "--config-dir", str(tree), "--check"])


def test_the_check_command_passes_on_the_repo_and_fails_on_a_stale_reference(tmp_path):
    assert ref.main(["--out", str(ref.REFERENCE), "--check"]) == 0
    stale = tmp_path / "train_config.yaml"
    stale.write_text(ref.REFERENCE.read_text().replace("  lr: 0.0002", "  lr: 0.001"))
    with pytest.raises(UserError, match="train-config-reference --out docs/train_config.yaml"):
        ref.main(["--out", str(stale), "--check"])
    ref.main(["--out", str(stale)])
    assert stale.read_text() == ref.REFERENCE.read_text()
