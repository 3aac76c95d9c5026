"""Consolidating a 2-rank FSDP2 (DCP) checkpoint gives the unsharded tensors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from export_helpers import load_dir_tensors, save_base
from pipeline import cli, layout

HERE = Path(__file__).resolve().parent


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


@pytest.fixture(scope="module")
def fsdp_checkpoints(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(HERE / "dcp_writer.py"), str(out), _free_port()],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    # The bases are the initial models the ranks started from (same seeds, unsharded).
    save_base(out / "lora_base", tied=True, seed=0)
    save_base(out / "full_base", tied=True, seed=2, shard="20KB")
    return out


def _reference(ckpt: Path, prefix: str) -> dict[str, torch.Tensor]:
    tensors = load_file(str(ckpt / "reference.safetensors"))
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


@pytest.mark.distributed
def test_lora_dcp_checkpoint_consolidates_to_unsharded_adapter(fsdp_checkpoints, tmp_path):
    ckpt, base = fsdp_checkpoints / "lora", fsdp_checkpoints / "lora_base"
    assert (ckpt / layout.DCP_DIR / layout.PEFT_CONFIG).is_file()
    rc = cli.main(["consolidate", "--checkpoint", str(ckpt), "--base", str(base),
                   "--out-adapter", str(tmp_path / "adapter"), "--out-adapter-ema", str(tmp_path / "ema"),
                   "--ema-rate", "0.999"])
    assert rc == 0
    for out, prefix in [(tmp_path / "adapter", "model."), (tmp_path / "ema", "ema.0.999.")]:
        expected = _reference(ckpt, prefix)
        produced = load_file(str(out / layout.PEFT_WEIGHTS))
        assert set(produced) == set(expected) and len(expected) == 28
        assert all(torch.equal(produced[k], expected[k]) for k in expected), out
        assert json.loads((out / layout.PEFT_CONFIG).read_text())["base_model_name_or_path"] == str(base.resolve())

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
    ids = torch.arange(12).reshape(2, 6)
    assert torch.isfinite(model(input_ids=ids).logits).all()


@pytest.mark.distributed
def test_full_dcp_checkpoint_consolidates_to_unsharded_model(fsdp_checkpoints, tmp_path):
    ckpt, base = fsdp_checkpoints / "full", fsdp_checkpoints / "full_base"
    rc = cli.main(["consolidate", "--checkpoint", str(ckpt), "--base", str(base), "--out-model",
                   str(tmp_path / "model"), "--out-model-ema", str(tmp_path / "ema"), "--max-shard-size", "30KB"])
    assert rc == 0
    base_names = set(load_dir_tensors(base))
    for out, prefix in [(tmp_path / "model", "model."), (tmp_path / "ema", "ema.0.999.")]:
        expected = _reference(ckpt, prefix)
        produced = load_dir_tensors(out)
        assert set(produced) == base_names and "lm_head.weight" in expected  # tied alias dropped
        assert all(torch.equal(produced[k], expected[k]) for k in produced), out
        assert (out / "model.safetensors.index.json").is_file()
    main = load_dir_tensors(tmp_path / "model")
    assert torch.equal(main["model.embed_tokens.weight"], load_dir_tensors(base)["model.embed_tokens.weight"])
