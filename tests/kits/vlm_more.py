"""More tiny random vision-language models of 2026, saved as real HF dirs (savers for
`tests/model/test_vlm_families.py`, which takes `MORE_SAVERS`).

Built as `tests/kits/vlm.py` builds its families: the family's stock transformers
class at test size, the demo tokenizer with the family's special tokens, and the
family's own processor class with its PIL image processor. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kits.vlm import (_QWEN3_5_TEXT, PIXTRAL_TEMPLATE, PIXTRAL_TOKENS, QWEN_TEMPLATE, QWEN_TOKENS, _family_tokenizer,
                      _save_parts, _text_config)


def save_mistral_large4(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Mistral Large 4 (`MistralLarge4ForConditionalGeneration`: a 1-block Pixtral tower, 8x8 patches
    merged 2x2; 2 decoder layers of multi-head latent attention with its sparse-attention indexer, the second a
    mixture of 4 experts stored fused and a shared expert; logits soft-capped) with Pixtral's processor, as
    Mistral Small 3 ships it (`kits.vlm.save_mistral3`): a 32x32 image scaled to 24x24 and padded to 2x2 `[IMG]`s
    with an `[IMG_BREAK]` after each row, the last `[IMG_END]`."""
    from transformers import MistralLarge4Config, MistralLarge4ForConditionalGeneration
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    tokenizer = _family_tokenizer(list(PIXTRAL_TOKENS), bos="<s>", eos="<|end|>", template=PIXTRAL_TEMPLATE)
    config = MistralLarge4Config(
        text_config=_text_config(tokenizer, model_type="mistral_large4_text", moe_intermediate_size=16,
                                 n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                 first_k_dense_replace=1, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                 v_head_dim=16, index_topk=64, index_head_dim=8, index_n_heads=2,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                 final_logit_softcapping=30.0),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, image_size=64, patch_size=8),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2)
    torch.manual_seed(seed)
    images = PixtralImageProcessorPil(size={"longest_edge": 24}, patch_size={"height": 8, "width": 8})
    return _save_parts(path, MistralLarge4ForConditionalGeneration(config), tokenizer, images, PIXTRAL_TEMPLATE,
                       "PixtralProcessor", patch_size=8, spatial_merge_size=2, image_token="[IMG]",
                       image_break_token="[IMG_BREAK]", image_end_token="[IMG_END]")


# HunYuanVL's image tokens (the tokenizer attributes its processor requires); an image is written
# `<image_start><image><image_end>`, the `<image>` expanded by the processor (its wrappers checked by it)
HUNYUAN_VL_TOKENS = {"image_start_token": "<image_start>", "image_token": "<image>", "image_end_token": "<image_end>"}
HUNYUAN_VL_TEMPLATE = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>",
                                            "<image_start><image><image_end>")


def save_hunyuan_vl(path: Path, *, seed: int = 0) -> Path:
    """A tiny random HunyuanOCR (`HunYuanVLForConditionalGeneration`: a 1-block tower on 8x8 patches, its patch
    merger a 2x2 convolution with a newline per row and begin / end features; 2 dense decoder layers with
    multimodal RoPE over (sequence, width, height, image)) with its own processor and PIL image processor: a
    32x32 image is 2 rows of 2 merged patches and a newline, between begin and end: 8 `<image>`s."""
    from transformers import HunYuanVLConfig, HunYuanVLForConditionalGeneration, HunYuanVLProcessor
    from transformers.models.hunyuan_vl.image_processing_pil_hunyuan_vl import HunYuanVLImageProcessorPil

    tokenizer = _family_tokenizer(list(HUNYUAN_VL_TOKENS.values()), bos="<s>", eos="<|end|>",
                                  template=HUNYUAN_VL_TEMPLATE, named=HUNYUAN_VL_TOKENS)
    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in HUNYUAN_VL_TOKENS.items()}
    config = HunYuanVLConfig(
        text_config=_text_config(tokenizer, head_dim=16, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2, 2]}),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           patch_size=8, spatial_merge_size=2, max_image_size=64, min_image_size=16),
        image_token_id=ids["image_token"], im_start_id=ids["image_start_token"], im_end_id=ids["image_end_token"],
        im_newline_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    HunYuanVLForConditionalGeneration(config).save_pretrained(path)
    images = HunYuanVLImageProcessorPil(min_pixels=16 * 16, max_pixels=32 * 32, patch_size=8, merge_size=2,
                                        temporal_patch_size=1)
    HunYuanVLProcessor(image_processor=images, tokenizer=tokenizer,
                       chat_template=HUNYUAN_VL_TEMPLATE).save_pretrained(path)
    return path


def save_hy_v4_vl(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Hy4-VL (`HYV4VLForConditionalGeneration`: a 1-block tower on 8x8 patches, HunyuanOCR's
    patch merger with a newline per row; 2 decoder layers of multi-head latent attention with a sparse-attention
    indexer, attention sinks and hyper-connections, the second a mixture of 4 experts stored fused and a shared
    expert) with Qwen's vision tokens and its PIL image processor: a 32x32 image is 2 rows of 2 merged patches
    and a newline, 6 `<|image_pad|>`s. Its processor is written as parts (its video processor needs torchvision)."""
    from transformers import HYV4VLConfig, HYV4VLForConditionalGeneration
    from transformers.models.hy_v4_vl.image_processing_pil_hy_v4_vl import HYV4VLImageProcessorPil

    tokenizer = _family_tokenizer(list(QWEN_TOKENS), bos="<s>", eos="<|end|>", template=QWEN_TEMPLATE)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
    config = HYV4VLConfig(
        text_config=_text_config(tokenizer, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                                 n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                                 qk_rope_head_dim=8, v_head_dim=16, index_topk=64, index_head_dim=8, index_n_heads=2,
                                 hc_mult=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "mrope_section": [2, 1, 1]}),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           out_hidden_size=32, patch_size=8, spatial_merge_size=2, max_image_size=64),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"])
    torch.manual_seed(seed)
    images = HYV4VLImageProcessorPil(min_pixels=16 * 16, max_pixels=32 * 32, patch_size=8, merge_size=2,
                                     temporal_patch_size=1)
    return _save_parts(path, HYV4VLForConditionalGeneration(config), tokenizer, images, QWEN_TEMPLATE,
                       "HYV4VLProcessor")


# MiniCPM-V 4.6's tokenizer attributes (its processor reads them): the template writes `<|image_pad|>` for an
# image, which the processor replaces by `<image>`, its `<|image_pad|>`s and `</image>` (and slices, if any)
MINICPMV_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "image_start_token": "<image>",
                   "image_end_token": "</image>", "slice_start_token": "<slice>", "slice_end_token": "</slice>",
                   "image_id_start_token": "<image_id>", "image_id_end_token": "</image_id>"}
MINICPMV_TEMPLATE = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<|image_pad|>")


def save_minicpmv(path: Path, *, seed: int = 0, version: str = "4_6") -> Path:
    """A tiny random MiniCPM-V 4.6 (`MiniCPMV4_6ForConditionalGeneration`: a 2-layer SigLIP-style tower on 4x4
    patches with its window-attention merger (2x2) after the first layer, the merger (2x2) after it; 2 Qwen3.5
    layers, Gated DeltaNet and attention) with its own processor and PIL image processor: a 32x32 image kept
    whole (no slices) is 4 `<|image_pad|>`s between `<image>` and `</image>`, after its id in the record
    (`<image_id>0</image_id>`). Its processor is written as parts (its video processor needs torchvision).
    `version="4_7"`: MiniCPM-V 4.7, the same layout with its own classes (its processor gives modality ids too;
    4.6's image and video processors)."""
    import transformers
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import MiniCPMV4_6ImageProcessorPil

    tokenizer = _family_tokenizer(list(MINICPMV_TOKENS.values()), bos="<s>", eos="<|end|>",
                                  template=MINICPMV_TEMPLATE, named=MINICPMV_TOKENS)
    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in MINICPMV_TOKENS.items()}
    config = getattr(transformers, f"MiniCPMV{version}Config")(
        text_config=_text_config(tokenizer, model_type="qwen3_5_text", **_QWEN3_5_TEXT),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=4),
        insert_layer_id=0, image_size=32, image_token_id=ids["image_token"], video_token_id=ids["video_token"],
        **(dict(image_start_id=ids["image_start_token"], image_end_id=ids["image_end_token"])
           if version == "4_7" else {}))
    torch.manual_seed(seed)
    images = MiniCPMV4_6ImageProcessorPil(scale_resolution=32, patch_size=4, max_slice_nums=1)
    model = getattr(transformers, f"MiniCPMV{version}ForConditionalGeneration")(config)
    _save_parts(path, model, tokenizer, images, MINICPMV_TEMPLATE, f"MiniCPMV{version}Processor")
    # what its video processor saves (settings its processor reads when built), by hand: it needs torchvision
    (Path(path) / "video_preprocessor_config.json").write_text(json.dumps(
        {"video_processor_type": "MiniCPMV4_6VideoProcessor", "scale_resolution": 32, "patch_size": 4,
         "max_slice_nums": 1, "slice_mode": True, "downsample_mode": "16x", "use_image_id": True}) + "\n")
    return path



GRANITE4_VISION_PINPOINTS = [[32, 32]]  # anyres with one grid: a 32x32 image is the whole image and one tile


def save_granite4_vision(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Granite 4 Vision (`Granite4VisionForConditionalGeneration`: a 1-layer CLIP tower on 32x32
    tiles, 8x8 patches; Window Q-Former projectors (one per deepstack pair, four spatial ones) downsampling 1/2, their
    features added to the image tokens' states at the decoder layers they target; 2 Granite-style layers, logits
    divided by `logits_scaling`) with its own processor and LLaVA-NeXT's PIL image processor."""
    from transformers import Granite4VisionConfig, Granite4VisionForConditionalGeneration, Granite4VisionProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    from kits.vlm import LLAVA_NEXT_TEMPLATE

    tokenizer = _family_tokenizer(["<image>", "[INST]", "[/INST]", "</s>"], bos="<s>", eos="</s>",
                                  template=LLAVA_NEXT_TEMPLATE, adds_bos=True)
    config = Granite4VisionConfig(
        text_config=_text_config(tokenizer, logits_scaling=8.0),
        vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=32, patch_size=8, projection_dim=16),
        qformer_config=dict(hidden_size=64, num_attention_heads=2, encoder_hidden_size=64, intermediate_size=32),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_grid_pinpoints=GRANITE4_VISION_PINPOINTS, vision_feature_select_strategy="default",
        vision_feature_layer=-1, downsample_rate="1/2", deepstack_layer_map=[[-1, 0]], spatial_vision_layer=-1,
        spatial_target_layers=[1, 1, 1, 1], projector_dropout=0.0)
    torch.manual_seed(seed)
    Granite4VisionForConditionalGeneration(config).save_pretrained(path)
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                        image_grid_pinpoints=GRANITE4_VISION_PINPOINTS)
    Granite4VisionProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8,
                            vision_feature_select_strategy="default", num_additional_image_tokens=1,
                            downsample_rate="1/2", chat_template=LLAVA_NEXT_TEMPLATE).save_pretrained(path)
    return path



LIGHTON_OCR_TOKENS = {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}


def save_lighton_ocr(path: Path, *, seed: int = 0) -> Path:
    """A tiny random LightOnOCR (`LightOnOcrForConditionalGeneration`: a 1-block Pixtral tower, 8x8 patches merged
    2x2 by its projector; 2 Qwen3 layers) with its own processor and Pixtral's PIL image processor, whose patch is
    the tower's patch x the merge (16): a 32x32 image is 2x2 `[IMG]`s."""
    from transformers import LightOnOcrConfig, LightOnOcrForConditionalGeneration, LightOnOcrProcessor
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    tokenizer = _family_tokenizer(list(LIGHTON_OCR_TOKENS.values()), bos="<s>", eos="<|end|>",
                                  template=PIXTRAL_TEMPLATE, named=LIGHTON_OCR_TOKENS)
    config = LightOnOcrConfig(
        text_config=_text_config(tokenizer, model_type="qwen3", head_dim=16),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, image_size=64, patch_size=8),
        image_token_id=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2)
    torch.manual_seed(seed)
    LightOnOcrForConditionalGeneration(config).save_pretrained(path)
    images = PixtralImageProcessorPil(size={"longest_edge": 32}, patch_size={"height": 16, "width": 16})
    LightOnOcrProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8, spatial_merge_size=2,
                        chat_template=PIXTRAL_TEMPLATE).save_pretrained(path)
    return path



COHERE_COMPASS_TOKENS = ("<|VISION_START|>", "<|VISION_END|>", "<|IMAGE_PAD|>", "<|VIDEO_PAD|>")
COHERE_COMPASS_TEMPLATE = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>",
                                                "<|VISION_START|><|IMAGE_PAD|><|VISION_END|>")


def save_cohere_compass(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Cohere Compass (`CohereCompassForConditionalGeneration`: Qwen3-VL's tower layout, 2 blocks on
    8x8 patches merged 2x2, a deepstack merger; 2 Cohere-style layers, one sliding-window, logits multiplied by
    `logit_scale`, 0.25 here) with its own processor's tokens and its PIL image processor: a 32x32 image is 4
    `<|IMAGE_PAD|>`s between `<|VISION_START|>` and `<|VISION_END|>`. Its processor is written as parts (its
    video processor needs torchvision)."""
    from transformers import CohereCompassConfig, CohereCompassForConditionalGeneration
    from transformers.models.cohere_compass.image_processing_pil_cohere_compass import CohereCompassImageProcessorPil

    tokenizer = _family_tokenizer(list(COHERE_COMPASS_TOKENS), bos="<s>", eos="<|end|>",
                                  template=COHERE_COMPASS_TEMPLATE)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in COHERE_COMPASS_TOKENS}
    config = CohereCompassConfig(
        text_config=_text_config(tokenizer, logit_scale=0.25, sliding_window=16,
                                 layer_types=["sliding_attention", "full_attention"],
                                 rope_parameters={t: {"rope_type": "default", "rope_theta": 10000.0,
                                                      "mrope_section": [2, 3, 3]}
                                                  for t in ("sliding_attention", "full_attention")}),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=8, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=[0]),
        image_token_id=ids["<|IMAGE_PAD|>"], video_token_id=ids["<|VIDEO_PAD|>"],
        vision_start_token_id=ids["<|VISION_START|>"], vision_end_token_id=ids["<|VISION_END|>"])
    torch.manual_seed(seed)
    images = CohereCompassImageProcessorPil(min_pixels=16 * 16, max_pixels=32 * 32, patch_size=8, merge_size=2,
                                            temporal_patch_size=2)
    return _save_parts(path, CohereCompassForConditionalGeneration(config), tokenizer, images,
                       COHERE_COMPASS_TEMPLATE, "CohereCompassProcessor")



def save_cosmos3_edge(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Cosmos 3 Edge (`Cosmos3EdgeForConditionalGeneration`: a 1-layer SigLIP-style tower on 8x8
    patches, its projector merging 2x2; 2 decoder layers) with Qwen's vision tokens and its PIL image processor:
    a 32x32 image is 4 `<|image_pad|>`s. Its processor is written as parts (its video processor needs
    torchvision)."""
    from transformers import Cosmos3EdgeConfig, Cosmos3EdgeForConditionalGeneration
    from transformers.models.cosmos3_edge.image_processing_pil_cosmos3_edge import Cosmos3EdgeImageProcessorPil

    tokenizer = _family_tokenizer(list(QWEN_TOKENS), bos="<s>", eos="<|end|>", template=QWEN_TEMPLATE)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
    config = Cosmos3EdgeConfig(
        text_config=_text_config(tokenizer, head_dim=16, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           patch_size=8, num_patches=16, spatial_merge_size=2),
        projector_hidden_size=32, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    images = Cosmos3EdgeImageProcessorPil(size={"shortest_edge": 16 * 16, "longest_edge": 32 * 32}, patch_size=8,
                                          merge_size=2, temporal_patch_size=1)
    return _save_parts(path, Cosmos3EdgeForConditionalGeneration(config), tokenizer, images, QWEN_TEMPLATE,
                       "Cosmos3EdgeProcessor")



OVIS2_INDICATORS = ("<IMG_START>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>", "<IMG_END>")
OVIS2_TEMPLATE = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")


def save_ovis2(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Ovis2 (`Ovis2ForConditionalGeneration`: a 1-layer tower on 32x32 images, 8x8 patches strided
    2x2 into 4 visual words, embedded through its visual embedding table; 2 Qwen2 layers) with its own processor and
    PIL image processor: an image is `<IMG_START>`, 4 `<IMG_ATOM>`s, `<IMG_GRID>`, `<IMG_END>`, its indicator
    tokens' features the table's last rows."""
    from transformers import Ovis2Config, Ovis2ForConditionalGeneration, Ovis2Processor
    from transformers.models.ovis2.image_processing_pil_ovis2 import Ovis2ImageProcessorPil

    tokenizer = _family_tokenizer(["<image>", "<IMG_ATOM>", *OVIS2_INDICATORS], bos="<s>", eos="<|end|>",
                                  template=OVIS2_TEMPLATE)
    config = Ovis2Config(
        text_config=_text_config(tokenizer, model_type="qwen2"),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8, hidden_stride=2, vocab_size=16),
        image_token_id=tokenizer.convert_tokens_to_ids("<IMG_ATOM>"),
        visual_indicator_token_ids=[tokenizer.convert_tokens_to_ids(t) for t in OVIS2_INDICATORS],
        vocab_size=len(tokenizer), hidden_size=32)
    torch.manual_seed(seed)
    Ovis2ForConditionalGeneration(config).save_pretrained(path)
    Ovis2Processor(image_processor=Ovis2ImageProcessorPil(size={"height": 32, "width": 32}), tokenizer=tokenizer,
                   chat_template=OVIS2_TEMPLATE, image_seq_length=4).save_pretrained(path)
    return path


# family -> saver, as tests/model/test_vlm_families.py's SAVERS take them (a `_moe` family's experts are asserted
# trained). Mistral Large 4 (`save_mistral_large4`) has its own test: stock peft does not load its adapter.
MORE_SAVERS = {
    "cohere_compass": save_cohere_compass,
    "cosmos3_edge": save_cosmos3_edge,
    "granite4_vision": save_granite4_vision,
    "hunyuan_vl": save_hunyuan_vl,
    "hy_v4_vl_moe": save_hy_v4_vl,
    "lighton_ocr": save_lighton_ocr,
    "minicpmv4_6": save_minicpmv,
    "minicpmv4_7": lambda path: save_minicpmv(path, version="4_7"),
    "ovis2": save_ovis2,
}


# families whose image processor exists only for torchvision (transformers 5.24 has no PIL backend for them):
# family -> (config class, processor class, image processor class)
TORCHVISION_ONLY = {
    "minimax_m3_vl": ("MiniMaxM3VLConfig", "MiniMaxM3VLProcessor", "MiniMaxM3VLImageProcessor"),
    "gemma4_unified": ("Gemma4UnifiedConfig", "Gemma4UnifiedProcessor", "Gemma4UnifiedImageProcessor"),
    "molmo2": ("Molmo2Config", "Molmo2Processor", "Molmo2ImageProcessor"),
    "step3p7": ("Step3p7Config", "Step3p7Processor", "Step3p7ImageProcessor"),
    "apertus1p5": ("Apertus1p5Config", "Apertus1p5Processor", "Apertus1p5ImageProcessor"),
    "nemotron_h_omni": ("NemotronH_Omni_Reasoning_V3_Config", "NemotronH_Omni_Reasoning_V3Processor",
                        "NemotronH_Omni_Reasoning_V3ImageProcessor"),
}


def save_torchvision_only(path: Path, family: str) -> Path:
    """A dir of a family whose image processor exists only for torchvision, as far as tokenizing reads it: the
    family's default config (no weights: the refusal comes before any), the demo tokenizer with Qwen's vision
    tokens, and its processor's and image processor's configs naming their classes."""
    import transformers

    from kits.vlm import _save_without_image_processor

    config_cls, processor_cls, image_cls = TORCHVISION_ONLY[family]
    tokenizer = _family_tokenizer(list(QWEN_TOKENS), bos="<s>", eos="<|end|>", template=QWEN_TEMPLATE)
    config = getattr(transformers, config_cls)()
    if config.vision_config is None:  # Gemma 4 Unified's vision part is optional: its checkpoints have one
        config = getattr(transformers, config_cls)(vision_config={})
    return _save_without_image_processor(path, config, tokenizer,
                                         {"image_processor_type": image_cls}, QWEN_TEMPLATE, processor_cls)
