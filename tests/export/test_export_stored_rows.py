"""A LoRA-adapted Linear weight the base stores as rows of another tensor: the merge adds each delta row where
the base keeps it, so the merged dir has the base's own layout and stock transformers loads it (under DoRA
each row rescaled by its own magnitude).

Sarvam-MoE's checkpoints hold `q_proj`, `k_proj` and `v_proj` as one `query_key_value` (grouped-query sizes, so
the three are not equal thirds); LaraMini's hold its linear attention's four input projections as one `in_proj`.
HRM's hold the attention's gate, q, k and v as one `gqkv_proj`. Transformers splits them on load and joins them
on save (`conversion_mapping`). Before the merge followed the rows, all three failed with "the base stores no
tensor ...q_proj.weight".
"""

from __future__ import annotations

import pytest
import torch

from pipeline.errors import UserError

FAMILIES = {  # config class, its settings beyond the common ones, the adapted modules
    "sarvam_moe": ("SarvamMoEConfig", {"num_key_value_heads": 2}, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "lara_mini": ("LaraMiniConfig", {}, ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]),
    # the attention's gate, q, k, v in one `gqkv_proj` and the MLP's gate and up in one `gate_up_proj`, cut in
    # equal chunks (in the floors env's transformers 5.17 too)
    "hrm_text": ("HrmTextConfig", {}, ["gate_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]),
}


def _save(family: str, path) -> None:
    """A tiny random model of `family` from its stock transformers class, with the demo tokenizer."""
    import transformers

    from pipeline.demo.text import build_tokenizer

    name, extra, _ = FAMILIES[family]
    if not hasattr(transformers, name):  # the floors env's transformers (5.17) predates both families
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    tokenizer = build_tokenizer()
    config = getattr(transformers, name)(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, hidden_size=32, num_attention_heads=4, head_dim=8, num_hidden_layers=2,
        intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def _adapter(base, out, modules, **lora) -> None:
    """A peft adapter on `modules` of the base, B randomized (not the zero init), saved to `out`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=modules, **lora))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    model.save_pretrained(out)


def _tensors(root) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(root.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_the_rows_of_a_fused_projection_are_where_transformers_stores_them(tmp_path):
    from pipeline.model.base_keys import BaseKeys

    _save("sarvam_moe", tmp_path / "base")
    keys = BaseKeys(tmp_path / "base", set(_tensors(tmp_path / "base")))
    fused = "model.layers.0.attention.query_key_value.weight"
    layout = {name: keys.rows(f"model.layers.0.self_attn.{name}.weight") for name in ("q_proj", "k_proj", "v_proj")}
    # 4 query heads and 2 key/value heads of 8: q's 32 rows first, then k's 16, then v's 16
    assert [[(p.key, p.live, p.stored) for p in parts] for parts in layout.values()] == [
        [(fused, tuple(range(32)), tuple(range(32)))],
        [(fused, tuple(range(16)), tuple(range(32, 48)))],
        [(fused, tuple(range(16)), tuple(range(48, 64)))]]
    assert keys.rows("model.layers.0.self_attn.o_proj.weight") is None  # stored whole, renamed (`dense`)


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_merge_into_rows_of_a_stored_tensor_verifies_and_loads_stock(family, use_dora, tmp_path):
    """DoRA too: its norm is per row of the live weight, so each row is rescaled where the base stores it (it
    was refused at the merge, after training: "k_proj has a DoRA magnitude, which the merge cannot split")."""
    from transformers import AutoModelForCausalLM

    from pipeline.export.merge import merge_dirs
    from pipeline.export.verify import verify

    base, adapter, merged = tmp_path / "base", tmp_path / "adapter", tmp_path / "merged"
    _save(family, base)
    _adapter(base, adapter, FAMILIES[family][2], use_dora=use_dora)
    merge_dirs(base, adapter, merged)

    before, after = _tensors(base), _tensors(merged)
    assert set(after) == set(before)  # the base's own layout: the fused tensor stays one tensor
    fused = [k for k in before if k.endswith(("attention.query_key_value.weight", "linear_attn.in_proj.weight",
                                              "attn.gqkv_proj.weight", "mlp.gate_up_proj.weight"))]
    assert fused and all(not torch.equal(after[k], before[k]) for k in fused), fused
    # merged logits == stock base + adapter (peft's forward) logits, and stock loading reads every tensor
    report = verify(base, adapter, merged, tmp_path / "verification.json", device="cpu")
    assert report["passed"] and report["max_abs_diff"] < 1e-4, report
    _, info = AutoModelForCausalLM.from_pretrained(merged, output_loading_info=True)
    assert not any(info.values()), info


def test_full_fine_tuning_consolidates_into_the_bases_rows(tmp_path):
    """Full fine-tuning (HRM: Sarvam-MoE and LaraMini store their experts apart, which full fine-tuning refuses
    at plan time): the checkpoint names `gate_proj`, `q_proj`, `k_proj`, `v_proj` as the live model does; the
    model dir is written in the base's layout (one `gqkv_proj`), and stock loading gives back every trained
    tensor exactly. The EMA shadow lacks `v_proj` (as a shadow may lack a weight): those rows come from the
    main weights, the other rows of the same tensor from the shadow."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from pipeline import cli, layout
    from pipeline.checkpoint import io as ckpt_io

    base, ckpt = tmp_path / "base", tmp_path / "ckpt"
    _save("hrm_text", base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.01)
    trained = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    ema = {k: v * 0.5 for k, v in trained.items() if not k.endswith("v_proj.weight")}
    for weights_dir, tensors in ((ckpt / layout.MODEL_DIR, trained), (ckpt / layout.EMA_DIR / "0.99", ema)):
        weights_dir.mkdir(parents=True)
        save_file(tensors, str(weights_dir / "model.safetensors"), metadata={"format": "pt"})
    (ckpt / layout.TRAINING_STATE_DIR).mkdir()
    (ckpt / layout.CHECKPOINT_CONFIG_FILE).write_text("seed: 0\n")
    ckpt_io.write_manifest(ckpt, step=1)

    out = tmp_path / "out"
    assert cli.main(["consolidate", "--checkpoint", str(ckpt), "--base", str(base), "--out-model", str(out / "model"),
                     "--out-model-ema", str(out / "model_ema")]) == 0
    assert set(_tensors(out / "model")) == set(_tensors(base))  # the base's own layout
    for produced, expected in ((out / "model", trained), (out / "model_ema", {**trained, **ema})):
        loaded, info = AutoModelForCausalLM.from_pretrained(produced, output_loading_info=True)
        assert not any(info.values()), info
        for name, tensor in loaded.state_dict().items():
            assert torch.equal(tensor, expected[name]), name
