"""Tiny random-weight vision-language models of two families, saved as real HF dirs, and their data.

LLaVA comes from the embedded default's builder (`pipeline.demo.vlm`) at test
size. Qwen2-VL is built here: the demo character tokenizer plus Qwen's vision
tokens, a chat template that writes them for an image part, Qwen2-VL's image
processor (8x8 patches, 2x2 merge: a 32x32 image is 4 image tokens) and
`processor_config.json` naming the processor class. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def save_llava(path: Path, *, seed: int = 0) -> Path:
    """A tiny random LLaVA (1-layer CLIP tower, 2-layer Llama) with the demo processor."""
    from pipeline.demo import vlm as demo_vlm

    tokenizer = demo_vlm.build_tokenizer()
    model = demo_vlm.build_model(tokenizer, vision_hidden=16, vision_layers=1, hidden=32, layers=2, heads=2, seed=seed)
    model.save_pretrained(path)
    demo_vlm.build_processor(tokenizer).save_pretrained(path)
    return path


def save_qwen2_vl(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Qwen2-VL (2 vision blocks, 2 decoder layers), tokenizer, image processor, template."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from pipeline.demo import text as demo

    tokenizer = demo.build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_TOKENS)})
    tokenizer.chat_template = QWEN_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(depth=2, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=8,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    Qwen2VLForConditionalGeneration(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=16 * 16, max_pixels=32 * 32, patch_size=8, merge_size=2,
                             temporal_patch_size=2).save_pretrained(path)
    (Path(path) / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}) + "\n")
    (Path(path) / "chat_template.jinja").write_text(QWEN_TEMPLATE)
    return path


def make_vlm_data(root: Path, model_dir: Path, *, n_train=32, n_val=8, n_test=8, max_length=96) -> dict:
    """The demo's colour questions for `model_dir`, tokenized into train / val caches."""
    from pipeline.demo import vlm as demo_vlm
    from pipeline.data.tokenize import load_chat, tokenize_file, tokenizer_fingerprint

    paths = demo_vlm.build_dataset(root / "data", n_train=n_train, n_val=n_val, n_test=n_test)
    tokenizer, images = load_chat(model_dir)
    fingerprint = tokenizer_fingerprint(model_dir)
    for split in ("train", "val"):
        tokenize_file(paths[split], tokenizer, out_path=root / f"{split}.safetensors", max_length=max_length,
                      too_long="error", fingerprint=fingerprint, split=split, images=images)
    return {"root": root, "model": model_dir, "train": root / "train.safetensors", "val": root / "val.safetensors",
            "test": paths["test"], "data": root / "data"}
