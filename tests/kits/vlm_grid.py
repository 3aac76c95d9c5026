"""Tiny random vision-language models of the families new in Transformers 5.24, saved as real HF dirs.

GLM-4.6V (`save_glm46v`), Qwen4-Exp (`save_qwen4_exp`), EXAONE 4.5 (`save_exaone4_5`), ERNIE 4.5 VL
(`save_ernie4_5_vl_moe`), GLM-5 Next (`save_glm5_next`), dots3-note (`save_dots3_note`), HyperCLOVA X SEED
Vision v2 (`save_hyperclovax_vision_v2`) and PaddleOCR-VL (`save_paddleocr_vl`). Each is built from its stock
transformers class with a real processor of its stock processor class: the demo's character tokenizer with the
family's special tokens (`kits.vlm._family_tokenizer`), its own image processor (PIL backend: a 32x32 image is
4 image tokens in all of them) and a chat template that writes its image tokens (not the shipped templates,
none of which is at hand here). A processor whose video half needs torchvision is written as parts, as a hub
checkpoint holds it. Nothing is downloaded. `GRID_SAVERS` maps each family, as
`tests/model/test_vlm_families.py` names it (`_moe`: a mixture of experts, whose experts are adapted), to its
saver.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from kits.vlm import (GLM4V_TEMPLATE, GLM4V_TOKENS, QWEN_TEMPLATE, QWEN_TOKENS, _family_tokenizer, _glm_images,
                      _glm_vision, _save_parts, _text_config)


def save_glm46v(path: Path, *, seed: int = 0) -> Path:
    """A tiny random GLM-4.6V (`Glm46VForConditionalGeneration`: GLM-4.1V's tower and decoder, 2 vision blocks,
    8x8 patches merged 2x2, 2 decoder layers with 3-D RoPE) with its own processor and image processor: a 32x32
    image is 4 `<|image|>`s with `image_grid_thw`. Written as parts (its video processor needs torchvision)."""
    from transformers import Glm46VConfig, Glm46VForConditionalGeneration
    from transformers.models.glm46v.image_processing_pil_glm46v import Glm46VImageProcessorPil

    tokenizer = _family_tokenizer(GLM4V_TOKENS, bos=None, eos="<|endoftext|>", template=GLM4V_TEMPLATE)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GLM4V_TOKENS}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2], "partial_rotary_factor": 0.5}
    config = Glm46VConfig(
        text_config=_text_config(tokenizer, model_type="glm4v_text", rope_parameters=rope),
        **_glm_vision(ids, model_type="glm4v_vision"))
    torch.manual_seed(seed)
    images = _glm_images(Glm46VImageProcessorPil)
    return _save_parts(path, Glm46VForConditionalGeneration(config), tokenizer, images, GLM4V_TEMPLATE,
                       "Glm46VProcessor")


def _qwen_parts(path: Path, model, tokenizer, processor_class: str) -> Path:
    """`model` saved with Qwen2-VL's image processor (PIL backend; 8x8 patches merged 2x2: a 32x32 image is 4
    `<|image_pad|>`s) and `processor_class`, written as parts (Qwen's video processors need torchvision)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    images = Qwen2VLImageProcessorPil(min_pixels=16 * 16, max_pixels=32 * 32, patch_size=8, merge_size=2,
                                      temporal_patch_size=2)
    return _save_parts(path, model, tokenizer, images, tokenizer.chat_template, processor_class)


def _qwen_ids(tokenizer) -> dict:
    """The config's ids of Qwen's vision tokens."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
    return dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])


def save_qwen4_exp(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Qwen4-Exp (`Qwen4ExpForConditionalGeneration`: Qwen3-VL's 2-block tower; 2 decoder layers, a
    Gated DeltaNet one with per-layer n-gram embeddings (PLE) and an attention one under its QSA token indexer, each
    a mixture of 4 experts stored fused with a shared expert, the residual stream widened 2x by hyper-connections)
    with Qwen3-VL's processor and Qwen2-VL's image processor, as Qwen4-Exp ships."""
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    tokenizer = _family_tokenizer(list(QWEN_TOKENS), bos="<s>", eos="<|end|>", template=QWEN_TEMPLATE)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}
    text = _text_config(tokenizer, rope_parameters=rope, head_dim=16,
                        layer_types=["linear_attention", "indexed_attention"], linear_conv_kernel_dim=2,
                        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                        linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                        num_experts=4, num_experts_per_tok=2, hc_count=2, hc_lowrank=8, ple_layer_ids=[1],
                        ple_embed_dim=16, ple_conv_kernel_size=2, heads_per_ngram=2, ngram_vocab_size_base=101,
                        make_ngram_vocab_size_divisible_by=8, split_ngram_parts=1, indexer_n_heads=2,
                        indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4)
    text.pop("intermediate_size")
    config = Qwen4ExpConfig(text_config=text, **_qwen_ids(tokenizer),
                            vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2,
                                               out_hidden_size=32, num_position_embeddings=16, patch_size=8,
                                               spatial_merge_size=2, temporal_patch_size=2))
    torch.manual_seed(seed)
    return _qwen_parts(path, Qwen4ExpForConditionalGeneration(config), tokenizer, "Qwen3VLProcessor")


def save_exaone4_5(path: Path, *, seed: int = 0) -> Path:
    """A tiny random EXAONE 4.5 (`Exaone4_5_ForConditionalGeneration`: a 2-block Qwen2.5-VL-style tower with
    grouped key-value heads, 8x8 patches merged 2x2; 2 EXAONE 4 layers, one sliding-window, one global, on 1-D
    positions) with its own processor and Qwen2-VL's image processor: a 32x32 image is 4 `<|image_pad|>`s."""
    from transformers import Exaone4_5_Config, Exaone4_5_ForConditionalGeneration

    tokenizer = _family_tokenizer(list(QWEN_TOKENS), bos="<s>", eos="<|end|>", template=QWEN_TEMPLATE)
    ids = _qwen_ids(tokenizer)
    config = Exaone4_5_Config(
        text_config=_text_config(tokenizer, model_type="exaone4", head_dim=16, sliding_window=16,
                                 layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, num_key_value_heads=1,
                           out_hidden_size=32, window_size=16, fullatt_block_indexes=[1], patch_size=8,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["image_token_id"], video_token_id=ids["video_token_id"])
    torch.manual_seed(seed)
    return _qwen_parts(path, Exaone4_5_ForConditionalGeneration(config), tokenizer, "Exaone4_5_Processor")


# ERNIE 4.5 VL's vision tokens, which its processor reads off the tokenizer by name
ERNIE_VL_TOKENS = {"image_token": "<|IMAGE_PLACEHOLDER|>", "image_start_token": "<|IMAGE_START|>",
                   "image_end_token": "<|IMAGE_END|>", "video_token": "<|VIDEO_PLACEHOLDER|>",
                   "video_start_token": "<|VIDEO_START|>", "video_end_token": "<|VIDEO_END|>"}
# its turns, an image as `<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>`: not the shipped template, no
# verbatim copy of which is at hand here
ERNIE_VL_TEMPLATE = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>",
                                          "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>")


def save_ernie4_5_vl_moe(path: Path, *, seed: int = 0) -> Path:
    """A tiny random ERNIE 4.5 VL (`Ernie4_5_VLMoeForConditionalGeneration`: a 2-block tower on 8x8 patches, its
    variable-resolution resampler merging 2x2; 2 decoder layers with 3-D RoPE, each a mixture of 4 text experts
    and 4 vision experts (image tokens and their start / end routed to the vision ones by
    `moe_mm_token_type_ids`) with a shared expert: the first layer's vision experts reach the answer through the
    second's attention) with its own processor and image processor (PIL): a 32x32 image is 4
    `<|IMAGE_PLACEHOLDER|>`s. Written as parts (its video processor needs torchvision)."""
    from transformers import Ernie4_5_VLMoeConfig, Ernie4_5_VLMoeForConditionalGeneration
    from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import (
        Ernie4_5_VLMoeImageProcessorPil,
    )

    tokenizer = _family_tokenizer(list(ERNIE_VL_TOKENS.values()), bos="<s>", eos="<|end|>",
                                  template=ERNIE_VL_TEMPLATE, named=ERNIE_VL_TOKENS)
    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in ERNIE_VL_TOKENS.items()}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]}
    config = Ernie4_5_VLMoeConfig(
        text_config=_text_config(tokenizer, rope_parameters=rope, head_dim=16, moe_intermediate_size=[16, 8],
                                 moe_k=2, moe_num_experts=4, moe_num_shared_experts=1,
                                 mlp_layer_types=["sparse", "sparse"]),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=8,
                           spatial_merge_size=2, temporal_merge_size=2),
        **{f"{k}_id": v for k, v in ids.items()})
    torch.manual_seed(seed)
    images = Ernie4_5_VLMoeImageProcessorPil(size={"shortest_edge": 16 * 16, "longest_edge": 32 * 32}, patch_size=8,
                                             merge_size=2)
    return _save_parts(path, Ernie4_5_VLMoeForConditionalGeneration(config), tokenizer, images, ERNIE_VL_TEMPLATE,
                       "Ernie4_5_VLMoeProcessor")


def save_glm5_next(path: Path, *, seed: int = 0) -> Path:
    """A tiny random GLM-5 Next (`Glm5NextForConditionalGeneration`, GLM-5.3-Flash's class: a 2-block tower on 8x8
    patches merged 2x2; 2 decoder layers, a KDA linear-attention one (dense MLP) and an MLA one under its DSA
    indexer (NoPE) with a mixture of 4 experts stored fused and a shared expert, the residual stream widened 2x by
    hyper-connections) with its own processor and image processor (PIL), GLM-4.1V's tokens and turns: a 32x32
    image is 4 `<|image|>`s. Written as parts (its video processor needs torchvision)."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
    from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

    tokenizer = _family_tokenizer(GLM4V_TOKENS, bos=None, eos="<|endoftext|>", template=GLM4V_TEMPLATE)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GLM4V_TOKENS}
    text = _text_config(tokenizer, moe_intermediate_size=16, n_shared_experts=1, n_routed_experts=4,
                        num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=0, v_head_dim=16,
                        qk_nope_head_dim=16, index_topk=16, index_kpool=16, index_head_dim=16, index_n_heads=2,
                        layer_types=["linear_attention", "indexed_attention"], indexer_types=["full", "full"],
                        mlp_layer_types=["dense", "sparse"], linear_head_dim=16, linear_num_heads=2,
                        linear_conv_kernel_dim=2, hc_mult=2, hc_sinkhorn_iters=3)
    config = Glm5NextConfig(
        text_config=text,
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           projection_intermediate_size=32, image_size=32, patch_size=8, spatial_merge_size=2,
                           temporal_patch_size=2),
        image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"], video_end_token_id=ids["<|end_of_video|>"])
    torch.manual_seed(seed)
    # its bounds are in image tokens (merged patches): a 32x32 image stays 32x32
    images = Glm5NextImageProcessorPil(min_image_tokens=4, max_image_tokens=4, patch_size=8, merge_size=2,
                                       temporal_patch_size=2)
    return _save_parts(path, Glm5NextForConditionalGeneration(config), tokenizer, images, GLM4V_TEMPLATE,
                       "Glm5NextProcessor")


# dots3-note's image tokens (its processor's are fixed: `<|imgpad|>`, `<|video_pad|>`, `<|audio_comp_pad|>`), and
# its turns with an image as `<|img|><|imgpad|><|endofimg|>`: not the shipped template, not at hand here
DOTS3_TOKENS = ["<|img|>", "<|imgpad|>", "<|endofimg|>", "<|video_pad|>", "<|audio_comp_pad|>"]
DOTS3_TEMPLATE = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<|img|><|imgpad|><|endofimg|>")


def save_dots3_note(path: Path, *, seed: int = 0) -> Path:
    """A tiny random dots3-note (`Dots3NoteForConditionalGeneration`: a 2-block tower on 8x8 patches, the second
    block a mixture of 4 experts, its merger 2x2 inside it; a 1-layer audio tower; 2 decoder layers, an MLA one
    under its DSA indexer and a sliding-window MLA one, the second a mixture of 4 experts stored fused with a
    shared expert) with its own processor, Qwen2-VL's image processor (PIL) and its audio feature extractor: a
    32x32 image is 4 `<|imgpad|>`s. Written as its processor saves it (its video processor needs torchvision)."""
    from transformers import Dots3NoteConfig, Dots3NoteForConditionalGeneration
    from transformers.models.dots3_note.feature_extraction_dots3_note import Dots3NoteFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = _family_tokenizer(DOTS3_TOKENS, bos="<s>", eos="<|end|>", template=DOTS3_TEMPLATE)
    mla = dict(head_dim=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=16, q_lora_rank=16)
    config = Dots3NoteConfig(
        text_config=_text_config(tokenizer, **mla, index_topk=8, index_head_dim=16, index_n_heads=2,
                                 layer_types=["indexed_attention", "sliding_attention"], sliding_window=16,
                                 **{f"swa_{k}": v for k, v in mla.items() if k != "qk_rope_head_dim"},
                                 swa_num_attention_heads=2, swa_num_key_value_heads=2, n_routed_experts=4,
                                 n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16,
                                 shared_experts_intermediate_size=16, mlp_layer_types=["dense", "sparse"]),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                           patch_size=8, spatial_merge_size=2, mlp_layer_types=["dense", "sparse"],
                           num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, adapter_in_dim=16,
                           adapter_out_dim=32, adapter_merge_size=2),
        audio_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                          feature_size=16, downsample_hidden_size=8, adapter_input_size=16, adapter_out_dim=32,
                          max_position_embeddings=64),
        image_token_id=tokenizer.convert_tokens_to_ids("<|imgpad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        audio_token_id=tokenizer.convert_tokens_to_ids("<|audio_comp_pad|>"))
    torch.manual_seed(seed)
    Dots3NoteForConditionalGeneration(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    # one frame a patch: its patch embedding is 2-D
    image = Qwen2VLImageProcessorPil(min_pixels=16 * 16, max_pixels=32 * 32, patch_size=8, merge_size=2,
                                     temporal_patch_size=1)
    halves = {"image_processor": image, "feature_extractor": Dots3NoteFeatureExtractor(feature_size=16)}
    video = dict(video_processor_type="Qwen3VLVideoProcessor", patch_size=8, merge_size=2, temporal_patch_size=1)
    (Path(path) / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Dots3NoteProcessor", "video_processor": video,
         **{name: json.loads(half.to_json_string()) for name, half in halves.items()}}, indent=2) + "\n")
    (Path(path) / "chat_template.jinja").write_text(DOTS3_TEMPLATE)
    return path


def save_hyperclovax_vision_v2(path: Path, *, seed: int = 0) -> Path:
    """A tiny random HyperCLOVA X SEED Vision v2 (`HyperCLOVAXVisionV2ForConditionalGeneration`: Qwen2.5-VL's
    2-block tower with its merger, then its own linear projector; 2 HyperCLOVA X layers, with muP-style
    multipliers) with its own processor and Qwen2-VL's image processor: a 32x32 image is 4 `<|image_pad|>`s."""
    from transformers import HyperCLOVAXVisionV2Config, HyperCLOVAXVisionV2ForConditionalGeneration

    tokenizer = _family_tokenizer(list(QWEN_TOKENS), bos="<s>", eos="<|end|>", template=QWEN_TEMPLATE)
    ids = _qwen_ids(tokenizer)
    config = HyperCLOVAXVisionV2Config(
        text_config=_text_config(tokenizer, model_type="hyperclovax", head_dim=16, embedding_multiplier=2.0,
                                 residual_multiplier=0.5, attention_multiplier=0.25, logits_scaling=0.5),
        vision_config=dict(model_type="qwen2_5_vl_vision", depth=2, hidden_size=16, intermediate_size=32,
                           num_heads=2, out_hidden_size=24, window_size=16, fullatt_block_indexes=[1],
                           patch_size=8, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["image_token_id"], video_token_id=ids["video_token_id"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    return _qwen_parts(path, HyperCLOVAXVisionV2ForConditionalGeneration(config), tokenizer,
                       "HyperCLOVAXVisionV2Processor")


def save_paddleocr_vl(path: Path, *, seed: int = 0) -> Path:
    """A tiny random PaddleOCR-VL (`PaddleOCRVLForConditionalGeneration`: a 2-layer NaViT-style tower on 8x8
    patches, its projector merging 2x2 beside it; 2 ERNIE 4.5 layers with 3-D RoPE) with its own processor (images
    only: it has no video half) and image processor (PIL), ERNIE 4.5 VL's tokens: a 32x32 image is 4
    `<|IMAGE_PLACEHOLDER|>`s."""
    from transformers import PaddleOCRVLConfig, PaddleOCRVLForConditionalGeneration, PaddleOCRVLProcessor
    from transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl import PaddleOCRVLImageProcessorPil

    named = {"image_token": ERNIE_VL_TOKENS["image_token"]}
    tokenizer = _family_tokenizer(list(ERNIE_VL_TOKENS.values()), bos="<s>", eos="<|end|>",
                                  template=ERNIE_VL_TEMPLATE, named=named)
    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in ERNIE_VL_TOKENS.items()}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    config = PaddleOCRVLConfig(
        text_config=_text_config(tokenizer, head_dim=16, rope_parameters=rope),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8, spatial_merge_size=2),
        image_token_id=ids["image_token"], video_token_id=ids["video_token"],
        vision_start_token_id=ids["image_start_token"], vision_end_token_id=ids["image_end_token"])
    torch.manual_seed(seed)
    PaddleOCRVLForConditionalGeneration(config).save_pretrained(path)
    images = PaddleOCRVLImageProcessorPil(min_pixels=16 * 16, max_pixels=32 * 32, patch_size=8, merge_size=2)
    PaddleOCRVLProcessor(image_processor=images, tokenizer=tokenizer, chat_template=ERNIE_VL_TEMPLATE
                         ).save_pretrained(path)
    return path


GRID_SAVERS = {
    "glm46v": save_glm46v,
    "qwen4_exp_moe": save_qwen4_exp,  # its decoder layers are all mixtures of experts
    "exaone4_5": save_exaone4_5,
    "ernie4_5_vl_moe": save_ernie4_5_vl_moe,
    "glm5_next_moe": save_glm5_next,  # GLM-5.3-Flash: its sparse layers mixtures of experts
    "dots3_note_moe": save_dots3_note,
    "hyperclovax_vision_v2": save_hyperclovax_vision_v2,
    "paddleocr_vl": save_paddleocr_vl,
}
