"""Model families beyond Llama: each trains one short stage, merges, and the merge verifies.

For every family a tiny random-weight model of that architecture (2 layers,
32 wide, the demo's char-level tokenizer and chat template) is written as a real
Hugging Face dir, then taken through the commands the workflow's rules call,
in this process (a subprocess per command would cost seconds of imports):
`plan` (LoRA target detection on the meta skeleton, memory estimate), `train`
(one stage of a few updates, with its final evaluation), `consolidate` (the
checkpoint's adapter -> a PEFT dir), `merge` (the streaming merge) and
`verify-merge` (merged logits == base + adapter). The merged dir must also load
with stock `AutoModelForCausalLM.from_pretrained`.

What each family brings: Qwen2 tied embeddings (and q/k/v biases), Qwen3 q/k
norms, Gemma tied embeddings scaled by sqrt(hidden) and its (1 + w) RMSNorm,
Mistral sliding-window attention, Phi-3 fused qkv_proj / gate_up_proj, GPT-2
Conv1D layers (weights stored transposed: [in, out]) and a tied head, Falcon Linear layers with a forward of
their own (adapted through their weights), Gemma 3n's text
model an intermediate size per layer (a list in its config), Gemma 4's text model a head size per layer
(twice as wide in its full-attention layers: a transformers per-layer config, whose global head_dim raises
on a read), layers that reuse
earlier layers' K/V, and Linear layers in ModuleLists (AltUp's projections); Zamba2 Mamba-2 layers
and a shared attention block with per-layer adapters, Linear layers in Sequentials in ModuleLists;
ModernBERT-decoder a prediction head (dense, activation, norm) between the last hidden states and the output
embedding.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from kits.train import make_run

UPDATES = 2
LAYERS, HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, POSITIONS = 2, 32, 4, 2, 64, 128


def _common(tokenizer) -> dict:
    return dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def _decoder(**extra) -> dict:
    """The shapes most decoder-only configs name alike."""
    return dict(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=POSITIONS, **extra)


def _config(family: str, tokenizer):
    import transformers as tf

    common = _common(tokenizer)
    if family == "llama":
        return tf.LlamaConfig(**_decoder(), tie_word_embeddings=False, **common)
    if family == "qwen2":
        return tf.Qwen2Config(**_decoder(), tie_word_embeddings=True, **common)
    if family == "qwen3":
        return tf.Qwen3Config(**_decoder(head_dim=HIDDEN // HEADS), tie_word_embeddings=False, **common)
    if family == "gemma":
        return tf.GemmaConfig(**_decoder(head_dim=HIDDEN // HEADS), tie_word_embeddings=True, **common)
    if family == "mistral":
        return tf.MistralConfig(**_decoder(sliding_window=16), tie_word_embeddings=False, **common)
    if family == "phi3":
        return tf.Phi3Config(**_decoder(), tie_word_embeddings=False, **common)
    if family == "gemma3n":  # four layers: the last two read the first two's K/V; layer 0's MLP is sparse
        return tf.Gemma3nTextConfig(**{**_decoder(head_dim=HIDDEN // HEADS), "num_hidden_layers": 4,
                                       "intermediate_size": [64, 64, 48, 48]}, **common, num_kv_shared_layers=2,
                                    layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=16,
                                    activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0], altup_num_inputs=2,
                                    laurel_rank=4, hidden_size_per_layer_input=8,
                                    vocab_size_per_layer_input=len(tokenizer), tie_word_embeddings=True)
    if family == "gemma4":  # head_dim 16 in its full-attention layer, 8 in the sliding one: a per-layer config
        return tf.Gemma4TextConfig(**_decoder(head_dim=HIDDEN // HEADS), **common, global_head_dim=2 * HIDDEN // HEADS,
                                   layer_types=["sliding_attention", "full_attention"], sliding_window=16,
                                   hidden_size_per_layer_input=8, vocab_size_per_layer_input=len(tokenizer),
                                   tie_word_embeddings=True)
    if family == "zamba2":  # a Mamba-2 layer, then a hybrid one: the shared attention + MLP block, LoRA-like adapters
        return tf.Zamba2Config(**{**_decoder(), "num_hidden_layers": 2}, **common, layers_block_type=["mamba", "hybrid"],
                               mamba_headdim=16, mamba_d_state=8, n_mamba_heads=4, chunk_size=16,
                               num_mem_blocks=1, attention_head_dim=16, adapter_rank=4, tie_word_embeddings=True)
    if family == "falcon":  # Falcon-40B / 180B's layout: grouped K/V heads in one fused projection
        return tf.FalconConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                               num_kv_heads=KV_HEADS, new_decoder_architecture=True, max_position_embeddings=POSITIONS,
                               tie_word_embeddings=True, **common)
    if family == "modernbert-decoder":  # a local (sliding) attention layer, then a global one
        return tf.ModernBertDecoderConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                                          num_attention_heads=HEADS, max_position_embeddings=POSITIONS,
                                          local_attention=16, global_attn_every_n_layers=2, **common)
    if family == "gpt2":
        return tf.GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=INTERMEDIATE, n_positions=POSITIONS,
                             **common)
    raise ValueError(family)


# family -> (the module names LoRA must adapt by default, tied head)
FAMILIES = {
    "llama": ({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, False),
    "qwen2": ({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, True),
    "qwen3": ({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, False),
    "gemma": ({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, True),
    "mistral": ({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, False),
    "phi3": ({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}, False),
    "gpt2": ({"c_attn", "c_proj", "c_fc"}, True),
    # FalconLinear: a Linear with a forward of its own, adapted through its weight (peft's ParamWrapper); peft's
    # default layer for the family (query_key_value) is not also given to it, which it refused
    "falcon": ({"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"}, True),
    # every Linear, as peft's all-linear: AltUp's (correction_coefs, prediction_coefs, modality_router and the
    # ModuleLists altup_projections / altup_unembed_projections, whose layers are named "0"), LAuReL's
    # (linear_left, linear_right) and the per-layer inputs'
    "gemma3n": ({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "0",
                 "correction_coefs", "prediction_coefs", "modality_router", "linear_left", "linear_right",
                 "per_layer_input_gate", "per_layer_projection", "per_layer_model_projection"}, True),
    # with its per-layer inputs' gate and projections
    "gemma4": ({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "per_layer_input_gate",
                "per_layer_projection", "per_layer_model_projection"}, True),
    # Mamba-2 and the shared block's attention and MLP, whose per-layer adapters are Linear layers in Sequentials
    # in ModuleLists (gate_up_proj_adapter_list.0.1: "1" or "0.1" alone would name other layers too)
    # its prediction head's dense layer (`lm_head.dense`, before the tied output embedding `decoder`) with the
    # layers' attention (Wo its output) and MLP (Wi, Wo)
    "modernbert-decoder": ({"q_proj", "k_proj", "v_proj", "Wo", "Wi", "dense"}, True),
    "zamba2": ({"in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj", "linear",
                "0", "1"}, True),
}


def save_family(family: str, path) -> None:
    """A random-weight model of `family` with the demo tokenizer, as a Hugging Face dir."""
    from transformers import AutoModelForCausalLM

    from pipeline.demo.text import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family, tokenizer))
    with torch.no_grad():  # Gemma 3n starts AltUp's output scale at 0, which would cut the per-layer inputs off
        for name, param in model.named_parameters():
            if name.endswith("correct_output_scale"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def _tensors(root) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in `root` (an HF model dir or a PEFT dir)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(root.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


# The trainer runs in this process and installs its preemption handlers: pytest gets its own back.
pytestmark = pytest.mark.usefixtures("own_signal_handlers")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_merges_and_verifies(family, tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    from pipeline.data.tokenize import tokenizer_fingerprint
    from pipeline.export.consolidate import consolidate
    from pipeline.export.merge import merge_dirs
    from pipeline.export.verify import probe_ids, verify
    from pipeline.train import stage

    targets, tied = FAMILIES[family]
    base = tmp_path / "base"
    save_family(family, base)
    # The token caches of `tiny` serve every family: they were made with this very tokenizer.
    assert tokenizer_fingerprint(base) == tokenizer_fingerprint(tiny["model"])
    data = {"model": base, "train": tiny["train"], "val": tiny["val"]}
    # lr 1e-2: two updates move the adapter far enough that the merge visibly changes the logits
    run = make_run(tmp_path / "run", data, total=UPDATES, fraction=0.5, chunks=1, single_stage=True,
                   overrides=["optim.lr=1e-2", "optim.warmup_fraction=0", "ema.rates=[]",
                              *(["lora.dropout=0"] if family == "falcon" else [])])  # a weight takes no dropout
    out = run.stage_dir("all")
    assert stage.main(["--plan", str(run.plan), "--config", str(run.config), "--stage", "all",
                       "--scratch", str(run.scratch("all")), "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == UPDATES and all(map(math.isfinite, losses))
    evals = [r for r in rows if r.get("event") == "eval"]  # the run's last update evaluates
    assert len(evals) == 1 and math.isfinite(evals[0]["val_raw"]), evals

    export = tmp_path / "export"
    consolidate(out / "checkpoint", base, out_adapter=export / "adapter_final", models="main")
    adapter = export / "adapter_final"
    adapted = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in _tensors(adapter)}
    assert adapted == targets  # every linear / Conv1D layer, not the head

    merge_dirs(base, adapter, export / "merged")
    merged_t, base_t = _tensors(export / "merged"), _tensors(base)
    assert set(merged_t) == set(base_t)  # same tensors: a tied head stays tied, not duplicated
    changed = {k.rsplit(".", 2)[-2] for k in merged_t if not torch.equal(merged_t[k], base_t[k])}
    # Gemma 3n reads correction_coefs' weight itself in training (clamped), past the layer's forward and so
    # past its LoRA pair, which then gets no gradient: adapted (peft's all-linear), never moved
    assert changed == targets - ({"correction_coefs"} if family == "gemma3n" else set())

    report = verify(base, adapter, export / "merged", export / "verification.json", device="cpu")
    assert report["passed"] and report["max_abs_diff"] < 1e-4, report  # fp32 merge: rounding only

    # Stock transformers loads it whole, tied as the base was, and the adapter changed what it
    # computes by far more than the merge's error.
    merged, info = AutoModelForCausalLM.from_pretrained(export / "merged", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    original = AutoModelForCausalLM.from_pretrained(base)
    if tied:
        assert merged.get_output_embeddings().weight is merged.get_input_embeddings().weight
    ids = probe_ids(merged.config.vocab_size, 2, 16, seed=0)
    with torch.no_grad():
        moved = (merged(ids, attention_mask=torch.ones_like(ids)).logits
                 - original(ids, attention_mask=torch.ones_like(ids)).logits).abs().max().item()
    assert moved > 100 * max(report["max_abs_diff"], 1e-7), (moved, report["max_abs_diff"])


def test_a_named_list_takes_a_list_of_linear_layers_by_its_name(tmp_path):
    """Linear layers kept in lists go by their list's name in a named list too: Zamba2's shared-block adapters
    (`gate_up_proj_adapter_list.0.0`, `.0.1`: Sequentials in a ModuleList), and nothing of another list."""
    from kits.train import REPO

    from pipeline import config as train_config
    from pipeline.model import targets
    from pipeline.model.base import meta_model

    save_family("zamba2", tmp_path / "base")
    cfg = train_config.resolve(REPO / "config/train", "config", [
        f"model.path={tmp_path / 'base'}", "tokens.train_cache=/t", "lora.target_modules=[gate_up_proj_adapter_list]"])
    chosen = targets.resolve(meta_model(cfg.model), cfg.lora, cfg.moe)
    assert chosen.modules == ["gate_up_proj_adapter_list.0.0", "gate_up_proj_adapter_list.0.1"], chosen.modules
