"""A sweep run by hand, not a test of the suite (its name keeps pytest from collecting it): every causal-LM family
of the installed transformers, built tiny from its stock config (sizes shrunk where the config has them; a few
families by hand in `_hand`), through plan -> one stage -> consolidate -> merge -> verify_merge. One JSON line per
family goes to $PROBE_OUT (default /tmp/probe_families.jsonl); $PROBE_TYPES limits it to some model types (a comma
list), $PROBE_OVERRIDES adds settings to each run (a space list, e.g. `lora.use_dora=true`).

    PROBE_OUT=/tmp/p.jsonl python -m pytest -o addopts="" tests/model/_probe_families.py -q

A failure at `config` or `build` is this sweep's tiny config, not the pipeline (the family's own sizes must agree,
as MLA's head dims or Mamba's heads); one at `train`, `export` or `verify` is worth reading. The README's
"Mixture of experts" section says what the sweeps found.
"""
from __future__ import annotations

import json
import math
import os
import traceback

import pytest
import torch
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from kits.train import make_run
from test_families import _tensors

SKIP = {"bart", "bert", "bert-generation", "big_bird", "bigbird_pegasus", "blenderbot", "blenderbot-small",
        "camembert", "data2vec-text", "electra", "ernie", "marian", "mbart", "megatron-bert", "mvp", "pegasus",
        "plbart", "prophetnet", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "trocr",
        "whisper", "xlm", "xlm-roberta", "xlm-roberta-xl", "xlnet", "xmod", "musicgen", "musicgen_melody", "moshi",
        "reformer", "ctrl", "openai-gpt", "cpmant", "git", "fuyu", "emu3", "got_ocr2", "phi4_multimodal",
        "moss_transcribe_diarize", "biogpt", "xglm", "gpt-sw3", "gpt_neox_japanese", "transfo-xl", "blt"}
TYPES = sorted(set(os.environ.get("PROBE_TYPES", ",".join(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)).split(",")) - SKIP)
SMALL = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             max_position_embeddings=256, moe_intermediate_size=16, num_experts=4, num_local_experts=4,
             n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, shared_expert_intermediate_size=16,
             kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
             first_k_dense_replace=1, n_embd=32, n_layer=2, n_head=4, d_model=32, num_layers=2)


def _hand(tokenizer):
    import transformers as tf
    common = dict(vocab_size=len(tokenizer), hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, intermediate_size=64, max_position_embeddings=128,
                  pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    mamba = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_expand=2, mamba_n_groups=1,
                 mamba_chunk_size=16)
    no_kv = {k: v for k, v in common.items() if k not in ("num_key_value_heads", "intermediate_size",
                                                          "max_position_embeddings")}
    return {
        "granitemoehybrid": lambda: tf.GraniteMoeHybridConfig(
            **common, **mamba, layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
            shared_intermediate_size=32),
        "bamba": lambda: tf.BambaConfig(**common, **mamba, attn_layer_indices=[1]),
        "olmo_hybrid": lambda: tf.OlmoHybridConfig(**common, layer_types=["linear_attention", "full_attention"]),
        "lfm2_moe": lambda: tf.Lfm2MoeConfig(**common, layer_types=["conv", "full_attention"], num_experts=4,
                                             num_experts_per_tok=2, moe_intermediate_size=16, num_dense_layers=1),
        "nemotron": lambda: tf.NemotronConfig(**common, head_dim=8),
        "falcon": lambda: tf.FalconConfig(**no_kv, new_decoder_architecture=True, num_kv_heads=2),
        "hunyuan_v1_dense": lambda: tf.HunYuanDenseV1Config(**common, head_dim=8),
        "hunyuan_v1_moe": lambda: tf.HunYuanMoEV1Config(**common, head_dim=8, num_experts=4, moe_topk=2),
        "ministral": lambda: tf.MinistralConfig(**common, head_dim=8),
        "xlstm": lambda: tf.xLSTMConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_heads=4,
                                        **{k: v for k, v in common.items() if k.endswith("token_id")}),
        "dots1": lambda: tf.Dots1Config(**common, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                        first_k_dense_replace=1, n_shared_experts=1),
    }


def _remade(config_class, tokenizer):
    """A config whose sizes vary per layer, made anew from the small sizes: its own `__post_init__` then sets
    the per-layer ones for 2 layers (Gemma 4's full-attention head size: `global_head_dim`, twice the others)."""
    import inspect

    params = inspect.signature(config_class).parameters
    sizes = {**SMALL, "num_hidden_layers": 2, "vocab_size": len(tokenizer), "vocab_size_per_layer_input": len(tokenizer),
             "hidden_size_per_layer_input": 8, "global_head_dim": 2 * SMALL["head_dim"], "tie_word_embeddings": False,
             **{key: getattr(tokenizer, key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}}
    if config_class.model_type.startswith("dots3"):  # its latent attention: as many K/V heads as query heads
        sizes["num_key_value_heads"] = SMALL["num_attention_heads"]
    return config_class(**{key: value for key, value in sizes.items()
                           if key in params or key == "global_head_dim" and "gemma4" in config_class.model_type})


def tiny_config(model_type, tokenizer):
    hand = _hand(tokenizer)
    if model_type in hand:
        return hand[model_type]()
    cfg = AutoConfig.for_model(model_type)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if getattr(cfg, "is_heterogeneous", False):  # sizes set per layer (Gemma 4, dots3), whose globals raise on a read
        return _remade(type(cfg), tokenizer)
    layers = getattr(cfg, "num_hidden_layers", None)
    for key, value in SMALL.items():
        if hasattr(cfg, key) and getattr(cfg, key) is not None:
            setattr(cfg, key, value)
    if layers:
        cfg.num_hidden_layers = 2
        for key, value in list(vars(cfg).items()):
            if isinstance(value, list) and len(value) == layers:
                setattr(cfg, key, value[:2])
    cfg.vocab_size = len(tokenizer)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(cfg, key, getattr(tokenizer, key))
    cfg.tie_word_embeddings = False
    return cfg


def record(row):
    with open(os.environ.get("PROBE_OUT", "/tmp/probe_families.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


pytestmark = pytest.mark.usefixtures("own_signal_handlers")


@pytest.mark.parametrize("model_type", TYPES)
def test_probe(model_type, tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    from pipeline.demo.text import build_tokenizer
    from pipeline.export.consolidate import consolidate
    from pipeline.export.merge import merge_dirs
    from pipeline.export.verify import verify
    from pipeline.train import stage

    step = "config"
    try:
        tokenizer = build_tokenizer()
        cfg = tiny_config(model_type, tokenizer)
        step = "build"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        base = tmp_path / "base"
        model.save_pretrained(base)
        tokenizer.save_pretrained(base)
        step = "train"
        data = {"model": base, "train": tiny["train"], "val": tiny["val"]}
        run = make_run(tmp_path / "run", data, total=2, fraction=0.5, chunks=1, single_stage=True,
                       overrides=["optim.lr=1e-2", "optim.warmup_fraction=0", "ema.rates=[]", "lora.dropout=0",
                                 *filter(None, os.environ.get("PROBE_OVERRIDES", "").split(" "))])
        out = run.stage_dir("all")
        assert stage.main(["--plan", str(run.plan), "--config", str(run.config), "--stage", "all",
                           "--scratch", str(run.scratch("all")), "--out", str(out)]) == 0
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in rows if "loss" in r]
        assert losses and all(map(math.isfinite, losses)), losses
        step = "export"
        export = tmp_path / "export"
        consolidate(out / "checkpoint", base, out_adapter=export / "adapter_final", models="main")
        adapted = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in _tensors(export / "adapter_final")})
        merge_dirs(base, export / "adapter_final", export / "merged")
        step = "verify"
        report = verify(base, export / "adapter_final", export / "merged", export / "v.json", device="cpu")
        assert report["passed"], json.dumps(report)[:3000]
        record({"type": model_type, "ok": True, "adapted": adapted})
    except BaseException as err:  # noqa
        record({"type": model_type, "ok": False, "step": step, "error": f"{type(err).__name__}: {err}"[:600],
                "trace": traceback.format_exc()[-1500:]})
        raise
