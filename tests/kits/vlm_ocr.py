"""Tiny random OCR vision-language models of Transformers 5.24, saved as real HF dirs.

DeepSeek-OCR 2 (`save_deepseek_ocr2`), GLM-OCR (`save_glm_ocr`), Qianfan-OCR (`save_qianfan_ocr`), DeepSeek-VL
and DeepSeek-VL hybrid (`save_deepseek_vl`); MiniCPM-OCR and Unlimited-OCR, whose image processors exist only for
torchvision, as far as tokenizing reads them (`save_ocr_torchvision_only`). Built as `tests/kits/vlm_grid.py`
builds its families: the family's stock transformers class at test size, the demo's character tokenizer with the
family's special tokens (`kits.vlm._family_tokenizer`), the family's own processor class (GLM-OCR: GLM-4.6V's, as
it ships) with its PIL image processor and a chat template that writes its image token (not the shipped template,
none of which is at hand here). Nothing is downloaded.
`OCR_SAVERS` maps each family, as `tests/model/test_vlm_families.py` names it (`_moe`: a mixture of experts, whose
experts are adapted), to its saver.
"""

from __future__ import annotations

from pathlib import Path

import torch
from kits.vlm import (GLM4V_TEMPLATE, GLM4V_TOKENS, INTERNVL_TOKENS, QWEN_TEMPLATE, _family_tokenizer, _glm_images,
                      _glm_vision, _save_parts, _text_config)

# DeepSeek-OCR 2's turns, an image as its processor's `<image>`: not the shipped template, not at hand here
DEEPSEEK_OCR2_TEMPLATE = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")


def save_deepseek_ocr2(path: Path, *, seed: int = 0) -> Path:
    """A tiny random DeepSeek-OCR 2 (`DeepseekOcr2ForConditionalGeneration`: a 1-layer SAM-style encoder on
    16x16 patches whose neck downsamples 4x, a 1-layer Qwen2-style encoder reading its patches and the tower's
    144 learned queries (the 768-px set: the tower always answers 144 or 256 features an image, whatever its
    size), a linear projector; 2 DeepSeek layers, the second a mixture of 4 experts stored fused with a shared
    expert) with its own processor and image processor (PIL): a 32x32 image, smaller than a 48-px tile, is not
    cropped; its global view, scaled to 48x48, is 12x12 `<image>`s (48 px / the processor's patch 4 x
    downsampling 1; the processor's count, which must be the tower's 144) and one for the view separator."""
    from transformers import DeepseekOcr2Config, DeepseekOcr2ForConditionalGeneration, DeepseekOcr2Processor
    from transformers.models.deepseek_ocr2.image_processing_pil_deepseek_ocr2 import DeepseekOcr2ImageProcessorPil

    tokenizer = _family_tokenizer(["<image>"], bos="<s>", eos="<|end|>", template=DEEPSEEK_OCR2_TEMPLATE)
    config = DeepseekOcr2Config(
        text_config=_text_config(tokenizer, moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1,
                                 num_experts_per_tok=2, mlp_layer_types=["dense", "sparse"]),
        vision_config=dict(
            sam_config=dict(hidden_size=16, output_channels=16, num_hidden_layers=1, num_attention_heads=2,
                            image_size=48, patch_size=16, window_size=2, global_attn_indexes=[0],
                            downsample_channels=[16, 16]),
            encoder_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2)),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(seed)
    DeepseekOcr2ForConditionalGeneration(config).save_pretrained(path)
    images = DeepseekOcr2ImageProcessorPil(size={"height": 48, "width": 48}, tile_size=48)
    DeepseekOcr2Processor(image_processor=images, tokenizer=tokenizer, patch_size=4, downsample_ratio=1,
                          chat_template=DEEPSEEK_OCR2_TEMPLATE).save_pretrained(path)
    return path


def save_glm_ocr(path: Path, *, seed: int = 0) -> Path:
    """A tiny random GLM-OCR (`GlmOcrForConditionalGeneration`: a 2-block GLM-4.1V-style tower on 8x8 patches
    merged 2x2; 2 GLM layers with 3-D RoPE) with GLM-4.6V's processor and image processor (PIL), as GLM-OCR ships:
    a 32x32 image is 4 `<|image|>`s with `image_grid_thw`. Written as parts (its video processor needs
    torchvision)."""
    from transformers import GlmOcrConfig, GlmOcrForConditionalGeneration
    from transformers.models.glm46v.image_processing_pil_glm46v import Glm46VImageProcessorPil

    tokenizer = _family_tokenizer(GLM4V_TOKENS, bos=None, eos="<|endoftext|>", template=GLM4V_TEMPLATE)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GLM4V_TOKENS}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    config = GlmOcrConfig(
        text_config=_text_config(tokenizer, rope_parameters=rope), **_glm_vision(ids))
    torch.manual_seed(seed)
    images = _glm_images(Glm46VImageProcessorPil)
    return _save_parts(path, GlmOcrForConditionalGeneration(config), tokenizer, images, GLM4V_TEMPLATE,
                       "Glm46VProcessor")


# Qianfan-OCR's turns, an image as its processor's placeholder `<image>` (which it expands to InternVL's
# `<img>`, `<IMG_CONTEXT>`s, `</img>`): not the shipped template, not at hand here
QIANFAN_OCR_TEMPLATE = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")


def save_qianfan_ocr(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Qianfan-OCR (`QianfanOCRForConditionalGeneration`: InternVL's layout, a 1-layer InternViT-style
    tower on 32x32 images, 8x8 patches, pixel shuffle 0.5; 2 Qwen3 layers) with its own processor and GOT-OCR2's
    image processor (PIL, one 32x32 tile): the template's `<image>` becomes `<img>`, 4 `<IMG_CONTEXT>`s,
    `</img>`."""
    from transformers import QianfanOCRConfig, QianfanOCRForConditionalGeneration, QianfanOCRProcessor
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    tokenizer = _family_tokenizer(["<|im_start|>", "<|im_end|>", "<image>", *INTERNVL_TOKENS.values()], bos="<s>",
                                  eos="<|end|>", template=QIANFAN_OCR_TEMPLATE, named=INTERNVL_TOKENS)
    config = QianfanOCRConfig(
        text_config=_text_config(tokenizer, model_type="qwen3", head_dim=16),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=[32, 32], patch_size=[8, 8]),
        image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"), image_seq_length=4, downsample_ratio=0.5)
    torch.manual_seed(seed)
    QianfanOCRForConditionalGeneration(config).save_pretrained(path)
    images = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, max_patches=1)
    QianfanOCRProcessor(image_processor=images, tokenizer=tokenizer, image_seq_length=4,
                        chat_template=QIANFAN_OCR_TEMPLATE).save_pretrained(path)
    return path


# DeepSeek-VL's image token, which its processor reads off the tokenizer by name, and its turns with an image as
# that token: not the shipped template, not at hand here
DEEPSEEK_VL_TOKENS = {"image_token": "<image_placeholder>"}
DEEPSEEK_VL_TEMPLATE = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image_placeholder>")


def save_deepseek_vl(path: Path, *, seed: int = 0, hybrid: bool = False) -> Path:
    """A tiny random DeepSeek-VL (`DeepseekVLForConditionalGeneration`: a 1-layer SigLIP tower on 32x32 images,
    8x8 patches, a 2-layer MLP aligner; 2 Llama layers) with its own processor and image processor (PIL): a 32x32
    image is 16 `<image_placeholder>`s (a feature a patch). `hybrid`: DeepSeek-VL hybrid
    (`DeepseekVLHybridForConditionalGeneration`), a 1-layer SAM tower beside it on a high-resolution copy of the
    image (32x32 here, its 8x8 patches resized and downsampled 4x to the SigLIP grid), the two views' features
    concatenated by its aligner: the same 16 tokens, `high_res_pixel_values` too."""
    import transformers

    prefix = "DeepseekVLHybrid" if hybrid else "DeepseekVL"
    module = "deepseek_vl_hybrid" if hybrid else "deepseek_vl"
    image_cls = getattr(__import__(f"transformers.models.{module}.image_processing_pil_{module}",
                                   fromlist=["_"]), f"{prefix}ImageProcessorPil")
    tokenizer = _family_tokenizer(list(DEEPSEEK_VL_TOKENS.values()), bos="<s>", eos="<|end|>",
                                  template=DEEPSEEK_VL_TEMPLATE, named=DEEPSEEK_VL_TOKENS)
    high_res = dict(high_res_vision_config=dict(hidden_size=16, output_channels=8, num_hidden_layers=1,
                                                num_attention_heads=2, image_size=32, patch_size=8, window_size=2,
                                                global_attn_indexes=[0], mlp_dim=32)) if hybrid else {}
    config = getattr(transformers, f"{prefix}Config")(
        text_config=_text_config(tokenizer, model_type="llama"),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8),
        image_token_id=tokenizer.convert_tokens_to_ids(DEEPSEEK_VL_TOKENS["image_token"]), **high_res)
    torch.manual_seed(seed)
    getattr(transformers, f"{prefix}ForConditionalGeneration")(config).save_pretrained(path)
    sizes = dict(high_res_size={"height": 32, "width": 32}) if hybrid else {}
    images = image_cls(size={"height": 32, "width": 32}, **sizes)
    getattr(transformers, f"{prefix}Processor")(image_processor=images, tokenizer=tokenizer, num_image_tokens=16,
                                                chat_template=DEEPSEEK_VL_TEMPLATE).save_pretrained(path)
    return path


# OCR families whose image processors exist only for torchvision (transformers 5.24 has no PIL backend for them):
# their config, processor and image processor classes
OCR_TORCHVISION_ONLY = {
    "minicpm_ocr": ("MiniCPMOcrConfig", "MiniCPMOcrProcessor", "MiniCPMOcrImageProcessor"),
    "unlimited_ocr": ("UnlimitedOcrConfig", "UnlimitedOcrProcessor", "UnlimitedOcrImageProcessor"),
}


def save_ocr_torchvision_only(path: Path, family: str) -> Path:
    """A dir of an `OCR_TORCHVISION_ONLY` family as far as tokenizing reads it: the family's default config (no
    weights: the refusal comes before any), the demo tokenizer with Qwen's vision tokens, and its processor's and
    image processor's configs naming their classes."""
    import transformers

    from kits.vlm import QWEN_TOKENS, _save_without_image_processor

    config_cls, processor_cls, image_cls = OCR_TORCHVISION_ONLY[family]
    tokenizer = _family_tokenizer(list(QWEN_TOKENS), bos="<s>", eos="<|end|>", template=QWEN_TEMPLATE)
    return _save_without_image_processor(path, getattr(transformers, config_cls)(), tokenizer,
                                         {"image_processor_type": image_cls}, QWEN_TEMPLATE, processor_cls)


OCR_SAVERS = {
    "deepseek_ocr2_moe": save_deepseek_ocr2,  # its text model's sparse layers mixtures of experts
    "glm_ocr": save_glm_ocr,
    "qianfan_ocr": save_qianfan_ocr,
    "deepseek_vl": save_deepseek_vl,
    "deepseek_vl_hybrid": lambda path: save_deepseek_vl(path, hybrid=True),
}
