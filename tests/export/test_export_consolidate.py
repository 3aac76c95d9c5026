"""`python -m pipeline consolidate` from HF-dir checkpoints (DCP ones: test_export_consolidate_dcp.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from export_helpers import SMALL_SHARD, load_dir_tensors, save_adapter, save_base, tree_digest
from pipeline import cli, layout
from pipeline.checkpoint import io as ckpt_io

REPO = Path(__file__).resolve().parents[2]


def _finish(ckpt: Path) -> Path:
    (ckpt / layout.TRAINING_STATE_DIR).mkdir(exist_ok=True)
    (ckpt / layout.CHECKPOINT_CONFIG_FILE).write_text("seed: 0\n")
    ckpt_io.write_manifest(ckpt, step=1)  # as the trainer does: every file's sha256, written last
    return ckpt


def _scaled_adapter(src: Path, dst: Path, factor: float) -> dict:
    shutil.copytree(src, dst)
    tensors = {k: v * factor for k, v in load_file(str(src / layout.PEFT_WEIGHTS)).items()}
    save_file(tensors, str(dst / layout.PEFT_WEIGHTS), metadata={"format": "pt"})
    return tensors


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA checkpoint in the HF layout: adapter/ plus ema/0.999/ and ema/0.9999/."""
    root = tmp_path_factory.mktemp("lora_run")
    model = save_base(root / "base", tied=True, shard=SMALL_SHARD)
    ckpt = root / "ckpt"
    save_adapter(model, ckpt / layout.ADAPTER_DIR)
    main = load_file(str(ckpt / layout.ADAPTER_DIR / layout.PEFT_WEIGHTS))
    ema = {tag: _scaled_adapter(ckpt / layout.ADAPTER_DIR, ckpt / layout.EMA_DIR / tag, factor)
           for tag, factor in ((layout.ema_tag(0.999), 0.5), (layout.ema_tag(0.9999), 0.25))}
    return root / "base", _finish(ckpt), main, ema


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """A full fine-tuning checkpoint: model/ and ema/0.99/ HF weights (tied embeddings, partial EMA)."""
    root = tmp_path_factory.mktemp("full_run")
    model = save_base(root / "base", tied=True, shard=SMALL_SHARD)
    torch.manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():  # the tied embedding is one parameter: moved once, stays tied
            param.add_(torch.randn_like(param) * 0.01)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    assert "lm_head.weight" in trained  # state_dict() lists the tied alias too
    ema = {k: v * 0.5 for k, v in trained.items() if "norm" not in k}  # norms left out of the EMA
    ckpt = root / "ckpt"
    for weights_dir, tensors in ((ckpt / layout.MODEL_DIR, trained), (ckpt / layout.EMA_DIR / "0.99", ema)):
        weights_dir.mkdir(parents=True)
        save_file(tensors, str(weights_dir / "model.safetensors"), metadata={"format": "pt"})
    return root / "base", _finish(ckpt), trained, ema


def test_lora_hf_checkpoint_exports_adapters(lora_run, tmp_path):
    base, ckpt, main, ema = lora_run
    out = tmp_path / "out"
    rc = cli.main(["consolidate", "--checkpoint", str(ckpt), "--base", str(base),
                   "--out-adapter", str(out / "adapter"), "--out-adapter-ema", str(out / "adapter_ema"),
                   "--ema-rate", "0.999", "--all-ema-dir", str(out / "ema_all")])
    assert rc == 0
    for produced, expected in [(out / "adapter", main), (out / "adapter_ema", ema["0.999"]),
                               (out / "ema_all" / "0.999", ema["0.999"]), (out / "ema_all" / "0.9999", ema["0.9999"])]:
        tensors = load_file(str(produced / layout.PEFT_WEIGHTS))
        assert set(tensors) == set(expected)
        assert all(torch.equal(tensors[k], expected[k]) for k in expected), produced
        config = json.loads((produced / layout.PEFT_CONFIG).read_text())
        assert config["base_model_name_or_path"] == str(base.resolve())
    assert sorted(p.name for p in (out / "ema_all").iterdir()) == ["0.999", "0.9999"]


def test_lora_export_casts_dtype(lora_run, tmp_path):
    base, ckpt, main, _ = lora_run
    out = tmp_path / "adapter"
    assert cli.main(["consolidate", "--checkpoint", str(ckpt), "--base", str(base), "--models", "main",
                     "--out-adapter", str(out), "--dtype", "bf16"]) == 0
    tensors = load_file(str(out / layout.PEFT_WEIGHTS))
    assert all(tensors[k].dtype == torch.bfloat16 and torch.equal(tensors[k], v.bfloat16()) for k, v in main.items())


def test_full_checkpoint_exports_sharded_models(full_run, tmp_path):
    base, ckpt, trained, ema = full_run
    out = tmp_path / "out"
    rc = cli.main(["consolidate", "--checkpoint", str(ckpt), "--base", str(base), "--out-model", str(out / "model"),
                   "--out-model-ema", str(out / "model_ema"), "--dtype", "bf16", "--max-shard-size", SMALL_SHARD])
    assert rc == 0
    base_names = set(load_dir_tensors(base))
    for produced, expected in [(out / "model", trained), (out / "model_ema", {**trained, **ema})]:
        tensors = load_dir_tensors(produced)
        assert set(tensors) == base_names and "lm_head.weight" not in tensors  # tied weight written once
        for name, tensor in tensors.items():
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name].bfloat16()), name
        assert len(list(produced.glob("model-*-of-*.safetensors"))) > 1
        index = json.loads((produced / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == base_names
        for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            assert (produced / name).is_file(), name
        config = json.loads((produced / "config.json").read_text())
        assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is True


def test_exports_load_with_stock_libraries_in_a_fresh_process(lora_run, full_run, tmp_path):
    lora_base, lora_ckpt, _, lora_ema = lora_run
    full_base, full_ckpt, trained, _ = full_run
    adapter_ema, model = tmp_path / "adapter_ema", tmp_path / "model"
    assert cli.main(["consolidate", "--checkpoint", str(lora_ckpt), "--base", str(lora_base), "--models", "ema",
                     "--out-adapter-ema", str(adapter_ema), "--ema-rate", "0.9999"]) == 0
    assert cli.main(["consolidate", "--checkpoint", str(full_ckpt), "--base", str(full_base), "--models", "main",
                     "--out-model", str(model)]) == 0
    save_file({k: v for k, v in trained.items() if k != "lm_head.weight"}, str(tmp_path / "expected.safetensors"))
    script = textwrap.dedent(f"""
        import torch
        from peft import PeftModel, get_peft_model_state_dict
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({str(lora_base)!r}),
                                               {str(adapter_ema)!r})
        loaded = get_peft_model_state_dict(peft_model)
        expected = load_file({str(lora_ckpt / 'ema' / '0.9999' / layout.PEFT_WEIGHTS)!r})
        assert set(loaded) == set(expected), set(loaded) ^ set(expected)
        assert all(torch.equal(loaded[k], expected[k]) for k in expected)

        model = AutoModelForCausalLM.from_pretrained({str(model)!r})
        expected = load_file({str(tmp_path / 'expected.safetensors')!r})
        state = model.state_dict()
        assert all(torch.equal(state[k], expected[k]) for k in expected)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        print("LOADED OK")
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert "LOADED OK" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--out-adapter", "{tmp}/a"], "needs --out-adapter-ema"),
        (["--models", "main", "--out-model", "{tmp}/m"], "is a LoRA run"),
        (["--out-adapter", "{tmp}/a", "--out-adapter-ema", "{tmp}/e"], "choose one with --ema-rate"),
        (["--out-adapter", "{tmp}/a", "--out-adapter-ema", "{tmp}/e", "--ema-rate", "0.5"], "has EMA rates"),
        (["--models", "main", "--out-adapter", "{tmp}/a", "--out-adapter-ema", "{tmp}/e"], "excludes EMA"),
        (["--models", "main", "--out-adapter", "{tmp}/a/b", "--all-ema-dir", "{tmp}/a"], "overlap"),
        (["--models", "main", "--out-adapter", "{base}/adapter"], "overlaps --base"),
        (["--models", "main", "--out-adapter", "{ckpt}/export"], "overlaps --checkpoint"),
    ],
)
def test_bad_requests_are_refused_before_writing(lora_run, tmp_path, capsys, extra, message):
    base, ckpt, _, _ = lora_run
    before = tree_digest(base.parent)
    args = [a.format(tmp=tmp_path, base=base, ckpt=ckpt) for a in extra]
    assert cli.main(["consolidate", "--checkpoint", str(ckpt), "--base", str(base), *args]) == 2
    assert message in capsys.readouterr().err
    assert tree_digest(base.parent) == before
    assert list(tmp_path.iterdir()) == []


def test_incomplete_checkpoint_is_refused(lora_run, tmp_path, capsys):
    base, ckpt, _, _ = lora_run
    partial = tmp_path / "partial"
    shutil.copytree(ckpt, partial)
    (partial / layout.MANIFEST_FILE).unlink()
    assert cli.main(["consolidate", "--checkpoint", str(partial), "--base", str(base), "--models", "main",
                     "--out-adapter", str(tmp_path / "a")]) == 2
    assert layout.MANIFEST_FILE in capsys.readouterr().err


def test_corrupt_checkpoint_is_refused_naming_the_file(lora_run, tmp_path, capsys):
    base, ckpt, _, _ = lora_run
    damaged = tmp_path / "damaged"
    shutil.copytree(ckpt, damaged)
    weights = damaged / layout.ADAPTER_DIR / layout.PEFT_WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01  # one flipped bit in the last tensor
    weights.write_bytes(bytes(data))
    assert cli.main(["consolidate", "--checkpoint", str(damaged), "--base", str(base), "--models", "main",
                     "--out-adapter", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert f"{weights} does not match its sha256" in err
    assert not (tmp_path / "a").exists()


def test_full_hf_checkpoint_exports_ema_in_fp16(tmp_path):
    base = tmp_path / "base"
    model = save_base(base, tied=False)
    ckpt = tmp_path / "ckpt"
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.5)
    model.save_pretrained(ckpt / layout.MODEL_DIR)  # one model.safetensors
    ema = {k: v * 0.5 for k, v in model.state_dict().items()}
    (ckpt / layout.EMA_DIR / "0.999").mkdir(parents=True)
    save_file(ema, str(ckpt / layout.EMA_DIR / "0.999" / "model.safetensors"), metadata={"format": "pt"})
    _finish(ckpt)
    out = tmp_path / "model_ema"
    assert cli.main(["consolidate", "--checkpoint", str(ckpt), "--base", str(base), "--models", "ema",
                     "--out-model-ema", str(out), "--dtype", "fp16"]) == 0
    produced = load_dir_tensors(out)
    assert set(produced) == set(ema) and "lm_head.weight" in produced  # untied: both stored, as in the base
    assert all(torch.equal(produced[k], v.half()) for k, v in ema.items())
    assert not (out / "model.safetensors.index.json").exists()  # small enough for one file
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
