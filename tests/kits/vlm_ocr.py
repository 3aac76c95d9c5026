"""Tiny random OCR vision-language models of Transformers 5.24, saved as real HF dirs.

DeepSeek-OCR 2 (`save_deepseek_ocr2`). Built as `tests/kits/vlm_grid.py` builds its families: the family's stock
transformers class at test size, the demo's character tokenizer with the family's special tokens
(`kits.vlm._family_tokenizer`), the family's own processor class with its PIL image processor and a chat template
that writes its image token (not the shipped template, none of which is at hand here). Nothing is downloaded.
`OCR_SAVERS` maps each family, as `tests/model/test_vlm_families.py` names it (`_moe`: a mixture of experts, whose
experts are adapted), to its saver.
"""

from __future__ import annotations

from pathlib import Path

import torch
from kits.vlm import QWEN_TEMPLATE, _family_tokenizer, _text_config

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


OCR_SAVERS = {
    "deepseek_ocr2_moe": save_deepseek_ocr2,  # its text model's sparse layers mixtures of experts
}
