"""Tiny random-weight mixture-of-experts and hybrid models, built from stock transformers classes.

`save_family(family, path)` writes a real Hugging Face dir (weights as
`save_pretrained` stores them: per-expert tensors for Qwen3-MoE, Mixtral, OLMoE,
Qwen3-Next, Qwen3.5-MoE, DeepSeek-V3, GLM-4.5 and Nemotron-H, fused for GPT-OSS and
Llama 4, under DeepSeek's own names for DeepSeek V4) with the demo's char-level
tokenizer and chat template, so the token caches of the `tiny` fixture serve
every family. Two layers (four for Nemotron-H: one of each block kind), 32 wide,
4 experts with 2 per token.
"""

from __future__ import annotations

import torch

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, POSITIONS = 32, 4, 2, 8, 128
EXPERTS, PER_TOKEN, EXPERT_WIDTH = 4, 2, 16

# family -> what LoRA adapts by default: (Linear layer names, fused expert weights), and what it must leave out
FAMILIES = {
    "qwen3_moe": ({"q_proj", "k_proj", "v_proj", "o_proj"}, {"experts.gate_up_proj", "experts.down_proj"}),
    "mixtral": ({"q_proj", "k_proj", "v_proj", "o_proj"}, {"experts.gate_up_proj", "experts.down_proj"}),
    "olmoe": ({"q_proj", "k_proj", "v_proj", "o_proj"}, {"experts.gate_up_proj", "experts.down_proj"}),
    "gpt_oss": ({"q_proj", "k_proj", "v_proj", "o_proj"}, {"experts.gate_up_proj", "experts.down_proj"}),
    # linear attention (Gated DeltaNet) + full attention; experts + a shared expert (its gate is a router)
    "qwen3_next": ({"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj",
                    "gate_proj", "up_proj", "down_proj"}, {"experts.gate_up_proj", "experts.down_proj"}),
    # Qwen3.5's text model: Qwen3-Next's layout with the linear attention's input projections split four ways
    "qwen3_5_moe": ({"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b",
                     "out_proj", "gate_proj", "up_proj", "down_proj"}, {"experts.gate_up_proj", "experts.down_proj"}),
    # multi-head latent attention (low-rank q and kv projections); a dense first layer, then experts + shared
    # experts, routed without a load-balancing loss (a bias per expert instead)
    "deepseek_v3": ({"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"}, {"experts.gate_up_proj", "experts.down_proj"}),
    # GLM-4.5: DeepSeek-V3's MoE layout with grouped-query attention
    "glm4_moe": ({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
                 {"experts.gate_up_proj", "experts.down_proj"}),
    # Llama 4's text model: experts + a shared expert in every layer, stored fused (as GPT-OSS stores them)
    "llama4_text": ({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
                    {"experts.gate_up_proj", "experts.down_proj"}),
    # DeepSeek V4: one shared K=V head, a grouped output projection (o_a_proj: a Linear subclass whose forward
    # is a block-diagonal bmm, so adapted through its weight), compressed attention (its gate_proj), a first
    # layer routed by token hash, then a routed layer; experts + a shared expert (its layers: shared_experts.*)
    "deepseek_v4": ({"q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj", "gate_proj"},
                    {"experts.gate_up_proj", "experts.down_proj"}),
    # Mistral 4: DeepSeek-V3's latent attention and experts, its experts stored fused; its causal-LM class is
    # registered in transformers 5.24 only for image-text-to-text (`pipeline.model.base.auto_class`)
    "mistral4": ({"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                  "down_proj"}, {"experts.gate_up_proj", "experts.down_proj"}),
    # Mamba-2 + attention + MoE (relu^2 experts: up_proj and down_proj) + MLP; peft refuses Mamba's out_proj
    "nemotron_h": ({"in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"},
                   {"experts.up_proj", "experts.down_proj"}),
    # Mamba-2 mixer beside attention in every layer, dense MLP; peft refuses Mamba's out_proj
    "falcon_h1": ({"in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, set()),
}
MOE = [f for f, (_, fused) in FAMILIES.items() if fused]

# family -> (adapter keys of one MoE layer's experts: peft nests the two ParamWrappers of its experts module,
#            a stored base tensor the merge must change: where the base keeps that layer's expert 0)
EXPERT_KEYS = {
    "qwen3_moe": ("model.layers.0.mlp.experts", "model.layers.0.mlp.experts.0.gate_proj.weight"),
    "mixtral": ("model.layers.0.mlp.experts", "model.layers.0.block_sparse_moe.experts.0.w1.weight"),
    "olmoe": ("model.layers.0.mlp.experts", "model.layers.0.mlp.experts.0.up_proj.weight"),
    "gpt_oss": ("model.layers.0.mlp.experts", "model.layers.0.mlp.experts.gate_up_proj"),
    "qwen3_next": ("model.layers.0.mlp.experts", "model.layers.0.mlp.experts.0.down_proj.weight"),
    "nemotron_h": ("model.layers.1.mixer.experts", "backbone.layers.1.mixer.experts.0.up_proj.weight"),
    "qwen3_5_moe": ("model.layers.0.mlp.experts", "model.layers.0.mlp.experts.0.down_proj.weight"),
    "deepseek_v3": ("model.layers.1.mlp.experts", "model.layers.1.mlp.experts.0.gate_proj.weight"),
    "glm4_moe": ("model.layers.1.mlp.experts", "model.layers.1.mlp.experts.0.up_proj.weight"),
    "llama4_text": ("model.layers.0.feed_forward.experts", "model.layers.0.feed_forward.experts.gate_up_proj"),
    "deepseek_v4": ("model.layers.1.mlp.experts", "model.layers.1.ffn.experts.0.w1.weight"),
    "mistral4": ("model.layers.1.mlp.experts", "model.layers.1.mlp.experts.gate_up_proj"),
}
# families whose model defines a load-balancing loss (`pipeline.model.router`)
ROUTER_LOSS = {"qwen3_moe", "mixtral", "olmoe", "gpt_oss", "qwen3_next", "qwen3_5_moe", "deepseek_v4"}
# families with no SDPA kernel in transformers: `model.attention=auto` picks eager
EAGER = {"gpt_oss", "deepseek_v4"}


def config(family: str, tokenizer):
    """The family's config, tiny, with the tokenizer's vocabulary and special ids."""
    import transformers as tf

    common = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, max_position_embeddings=POSITIONS, tie_word_embeddings=False)
    attention = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS)
    experts = dict(num_experts_per_tok=PER_TOKEN)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, **attention, **experts, head_dim=HEAD_DIM, num_hidden_layers=2,
                                 intermediate_size=64, moe_intermediate_size=EXPERT_WIDTH, num_experts=EXPERTS)
    if family == "mixtral":
        return tf.MixtralConfig(**common, **attention, **experts, num_hidden_layers=2, intermediate_size=EXPERT_WIDTH,
                                num_local_experts=EXPERTS)
    if family == "olmoe":
        return tf.OlmoeConfig(**common, **attention, **experts, num_hidden_layers=2, intermediate_size=EXPERT_WIDTH,
                              num_experts=EXPERTS)
    if family == "gpt_oss":
        return tf.GptOssConfig(**common, **attention, **experts, head_dim=HEAD_DIM, num_hidden_layers=2,
                               intermediate_size=EXPERT_WIDTH, num_local_experts=EXPERTS, sliding_window=16,
                               layer_types=["sliding_attention", "full_attention"],
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "qwen3_next":
        return tf.Qwen3NextConfig(**common, **attention, **experts, head_dim=HEAD_DIM, num_hidden_layers=2,
                                  layer_types=["linear_attention", "full_attention"], intermediate_size=64,
                                  linear_conv_kernel_dim=2, linear_key_head_dim=8, linear_value_head_dim=8,
                                  linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=EXPERT_WIDTH,
                                  shared_expert_intermediate_size=EXPERT_WIDTH, num_experts=EXPERTS)
    if family == "qwen3_5_moe":
        return tf.Qwen3_5MoeTextConfig(**common, **attention, **experts, head_dim=HEAD_DIM, num_hidden_layers=2,
                                       layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=2,
                                       linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                                       linear_num_value_heads=4, moe_intermediate_size=EXPERT_WIDTH,
                                       shared_expert_intermediate_size=EXPERT_WIDTH, num_experts=EXPERTS)
    if family == "deepseek_v3":  # latent attention: as many K/V heads as query heads
        return tf.DeepseekV3Config(**common, **{**attention, "num_key_value_heads": HEADS}, **experts,
                                   num_hidden_layers=2, first_k_dense_replace=1, intermediate_size=64,
                                   moe_intermediate_size=EXPERT_WIDTH, n_routed_experts=EXPERTS, n_shared_experts=1,
                                   n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                                   qk_nope_head_dim=4, v_head_dim=HEAD_DIM)
    if family == "glm4_moe":
        return tf.Glm4MoeConfig(**common, **attention, **experts, head_dim=HEAD_DIM, num_hidden_layers=2,
                                first_k_dense_replace=1, intermediate_size=64, moe_intermediate_size=EXPERT_WIDTH,
                                n_routed_experts=EXPERTS, n_shared_experts=1, n_group=1, topk_group=1)
    if family == "llama4_text":  # Llama 4 routes each token to one expert
        return tf.Llama4TextConfig(**common, **attention, head_dim=HEAD_DIM, num_hidden_layers=2,
                                   intermediate_size=EXPERT_WIDTH, intermediate_size_mlp=64, num_local_experts=EXPERTS,
                                   num_experts_per_tok=1, interleave_moe_layer_step=1)
    if family == "deepseek_v4":
        return tf.DeepseekV4Config(**common, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=1,
                                   head_dim=HEAD_DIM, qk_rope_head_dim=4, q_lora_rank=16, o_groups=2, o_lora_rank=16,
                                   index_n_heads=2, index_head_dim=HEAD_DIM, index_topk=8, sliding_window=8,
                                   num_hidden_layers=2, mlp_layer_types=["hash_moe", "moe"],
                                   moe_intermediate_size=EXPERT_WIDTH, n_routed_experts=EXPERTS, n_shared_experts=1,
                                   **experts)
    if family == "mistral4":  # latent attention, as DeepSeek-V3's
        return tf.Mistral4Config(**common, **{**attention, "num_key_value_heads": HEADS}, **experts,
                                 num_hidden_layers=2, first_k_dense_replace=1, intermediate_size=64,
                                 moe_intermediate_size=EXPERT_WIDTH, n_routed_experts=EXPERTS, n_shared_experts=1,
                                 n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                                 qk_nope_head_dim=4, v_head_dim=HEAD_DIM)
    if family == "nemotron_h":
        return tf.NemotronHConfig(**common, **attention, **experts, head_dim=HEAD_DIM,
                                  layers_block_type=["mamba", "moe", "attention", "mlp"], intermediate_size=64,
                                  ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=8, n_groups=1, conv_kernel=4,
                                  expand=1, chunk_size=16, n_routed_experts=EXPERTS, moe_intermediate_size=EXPERT_WIDTH,
                                  moe_shared_expert_intermediate_size=EXPERT_WIDTH, n_shared_experts=1, n_group=1,
                                  topk_group=1)
    if family == "falcon_h1":
        return tf.FalconH1Config(**common, **attention, num_hidden_layers=2, intermediate_size=64, mamba_d_ssm=32,
                                 mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4,
                                 mamba_expand=1, mamba_chunk_size=16)
    raise ValueError(family)


def save_family(family: str, path, *, seed: int = 0) -> None:
    """A random-weight model of `family` with the demo tokenizer, as a Hugging Face dir."""
    from pipeline.demo.text import build_tokenizer
    from pipeline.model.base import auto_class

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    built = config(family, tokenizer)
    model = auto_class(built).from_config(built)
    with torch.no_grad():  # routers that start at zero (Qwen3-MoE's, OLMoE's) would route every token alike
        for name, param in model.named_parameters():
            if param.ndim == 2 and name.rsplit(".", 2)[-2] in ("gate", "router") and not param.abs().sum():
                param.normal_(0, 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
