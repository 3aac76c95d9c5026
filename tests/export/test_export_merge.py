"""`python -m pipeline merge`: streaming merge == peft's merge_and_unload, and the base stays untouched."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from export_helpers import LLAMA_TARGETS, load_dir_tensors, tree_digest
from pipeline import cli
from pipeline.storage.hf_dir import WEIGHTS_INDEX


def _peft_merged(base, adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter).merge_and_unload().state_dict()


@pytest.mark.parametrize(
    "tied, shard",
    [(False, "20KB"), (True, "20KB"), (True, None)],
    ids=["sharded", "sharded-tied", "single-file-tied"],
)
def test_merge_matches_peft_merge_and_unload(llama_pair, tmp_path, tied, shard):
    base, adapter = llama_pair(tied=tied, shard=shard)
    out = tmp_path / "merged"
    assert cli.main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out)]) == 0

    ours = load_dir_tensors(out)
    original = load_dir_tensors(base)
    expected = _peft_merged(base, adapter)
    assert set(ours) == set(original)  # same tensors as the base: nothing added, nothing dropped
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-6, atol=1e-6, msg=name)
    changed = {name.split(".")[-2] for name in ours if not torch.equal(ours[name], original[name])}
    assert changed == set(LLAMA_TARGETS)  # every target moved, nothing else did

    if shard:  # same shards, same weight_map as the base
        assert json.loads((out / WEIGHTS_INDEX).read_text())["weight_map"] == \
            json.loads((base / WEIGHTS_INDEX).read_text())["weight_map"]
        assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(p.name for p in base.glob("*.safetensors"))
    else:
        assert not (out / WEIGHTS_INDEX).exists()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    if tied:
        assert "lm_head.weight" not in ours  # tying kept, not duplicated
        from transformers import AutoModelForCausalLM

        merged = AutoModelForCausalLM.from_pretrained(out)
        assert merged.lm_head.weight is merged.model.embed_tokens.weight


def test_merge_casts_to_requested_dtype(llama_pair, tmp_path):
    base, adapter = llama_pair(tied=True)
    out = tmp_path / "merged"
    assert cli.main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out),
                     "--dtype", "bf16"]) == 0
    ours = load_dir_tensors(out)
    expected = _peft_merged(base, adapter)
    assert {t.dtype for t in ours.values()} == {torch.bfloat16}
    for name, tensor in ours.items():
        # summed in fp32 then rounded once: exactly the fp32 result rounded to bf16
        torch.testing.assert_close(tensor, expected[name].to(torch.bfloat16), rtol=0, atol=0, msg=name)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    index = json.loads((out / WEIGHTS_INDEX).read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in ours.values())


def test_merge_keeps_fp16_base_dtype(llama_pair, tmp_path):
    base, adapter = llama_pair(shard=None, dtype=torch.float16)
    out = tmp_path / "merged"
    assert cli.main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out)]) == 0
    ours = load_dir_tensors(out)
    assert {t.dtype for t in ours.values()} == {torch.float16}
    expected = _peft_merged(base, adapter)
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor.float(), expected[name], rtol=2e-3, atol=1e-3, msg=name)


@pytest.mark.parametrize("where", ["inside", "equal", "parent"])
def test_output_overlapping_base_is_refused_and_base_unchanged(llama_pair, tmp_path, capsys, where):
    base, adapter = llama_pair(tied=True)
    before = tree_digest(base.parent)
    out = {"inside": base / "merged", "equal": base, "parent": base.parent}[where]
    rc = cli.main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--overwrite"])
    assert rc == 2
    assert "overlaps --base" in capsys.readouterr().err
    assert tree_digest(base.parent) == before  # every file of base (and adapter) byte-identical
    assert not (base / "merged").exists()


def test_output_inside_base_via_symlink_is_refused(llama_pair, tmp_path):
    base, adapter = llama_pair(tied=True)
    before = tree_digest(base)
    link = tmp_path / "link"
    link.symlink_to(base, target_is_directory=True)
    rc = cli.main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(link / "out")])
    assert rc == 2
    assert tree_digest(base) == before


def test_non_empty_output_needs_overwrite(llama_pair, tmp_path, capsys):
    base, adapter = llama_pair()
    out = tmp_path / "merged"
    out.mkdir()
    (out / "stale.safetensors").write_bytes(b"x")
    args = ["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out)]
    assert cli.main(args) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli.main(args + ["--overwrite"]) == 0
    assert not (out / "stale.safetensors").exists()  # replaced as a whole, no stale shard left
    assert not list(tmp_path.glob(".merged*"))  # no staging leftovers


def _adapter_copy(adapter, tmp_path, *, config=None, tensors=None):
    dst = tmp_path / "adapter_copy"
    dst.mkdir()
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg.update(config or {})
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    weights = tensors(weights) if tensors else weights
    save_file(weights, str(dst / "adapter_model.safetensors"))
    return dst


@pytest.mark.parametrize(
    "case, message",
    [
        ("dora_without_magnitudes", "sets use_dora, but module"),
        ("extra_tensor", "not LoRA A/B weights"),
        ("missing_half", "has only its lora_A"),
        ("unknown_module", "stores no tensor"),
        ("lm_head_tied", "stores no tensor 'lm_head.weight'"),
        ("rank_mismatch", "disagree with the config's rank"),
    ],
)
def test_unmergeable_adapters_are_refused_before_writing(llama_pair, tmp_path, capsys, case, message):
    base, adapter = llama_pair(tied=True)
    a_key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    edits = {
        "dora_without_magnitudes": dict(config={"use_dora": True}),
        "extra_tensor": dict(tensors=lambda w: {**w, "base_model.model.model.norm.weight": torch.ones(32)}),
        "missing_half": dict(tensors=lambda w: {k: v for k, v in w.items() if "q_proj.lora_B" not in k}),
        "unknown_module": dict(tensors=lambda w: {k.replace("q_proj", "qq_proj"): v for k, v in w.items()}),
        "lm_head_tied": dict(tensors=lambda w: {
            **w,
            "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 32),
            "base_model.model.lm_head.lora_B.weight": torch.zeros(vocab, 4),
        }),
        "rank_mismatch": dict(tensors=lambda w: {**w, a_key: torch.zeros(3, 32)}),
    }
    bad = _adapter_copy(adapter, tmp_path, **edits[case])
    out = tmp_path / "merged"
    rc = cli.main(["merge", "--base", str(base), "--adapter", str(bad), "--out", str(out)])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
