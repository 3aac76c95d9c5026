"""Tiny random-weight vision-language models, saved as real HF dirs, and their data.

LLaVA comes from the embedded default's builder (`pipeline.demo.vlm`) at test
size. Qwen2-VL is built here: the demo character tokenizer plus Qwen's vision
tokens, a chat template that writes them for an image part, Qwen2-VL's image
processor (8x8 patches, 2x2 merge: a 32x32 image is 4 image tokens) and
`processor_config.json` naming the processor class. Qwen2.5-VL, Qwen3-VL and Qwen3.5
take the same tokenizer and image processor with their own model classes and their
shipped chat templates (`save_qwen_vl`); Gemma 3 (`save_gemma3`) its own processor, whose template
writes `<start_of_image>` for an image, expanded to 4 `<image_soft_token>`s
between it and `<end_of_image>`; Gemma 4 (`save_gemma4`, dense or with experts), Mistral Small 3
(`save_mistral3`, Pixtral's processor settings) and Llama 4 (`save_llama4`, fused experts) are saved
as their processors save them (their processors cannot all be built without torchvision).
SmolVLM2 / Idefics3 (`save_smolvlm`), InternVL3 (`save_internvl`),
LLaVA-NeXT (`save_llava_next`), GLM-4.1V (`save_glm4v`) and LFM2-VL (`save_lfm2_vl`) take the demo
tokenizer with their special tokens, their own image processors (PIL backends) and, where known, their
shipped chat templates (sources named); those whose processor holds a torchvision-only video processor
are written as parts, as a hub checkpoint holds them. Nothing is downloaded.
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
    return save_qwen_vl(path, "qwen2_vl", seed=seed)


# family -> (config class, model class, processor class, vision config): 2 blocks, 8x8 patches, 2x2 merge
_QWEN_VL = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor",
                 dict(depth=2, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2)),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor",
                   dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, window_size=16,
                        fullatt_block_indexes=[1])),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "Qwen3VLProcessor",
                 dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                      num_position_embeddings=16, deepstack_visual_indexes=[0])),
    # Qwen3-VL-30B-A3B / 235B-A22B: Qwen3-VL's composite with a mixture of experts stored fused
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", "Qwen3VLProcessor",
                     dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                          num_position_embeddings=16, deepstack_visual_indexes=[0])),
    # Qwen3.5's checkpoints are this composite class (Gated DeltaNet + attention layers, a vision tower),
    # dense and mixture of experts alike, with Qwen3-VL's processor
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", "Qwen3VLProcessor",
                dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                     num_position_embeddings=16)),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", "Qwen3VLProcessor",
                    dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                         num_position_embeddings=16)),
}
# The text model's settings beyond the common ones: Qwen3.5's layer mix and linear-attention heads
_QWEN3_5_TEXT = dict(head_dim=16, layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=2,
                     linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
_TEXT = {"qwen3_vl": dict(head_dim=16), "qwen3_5": _QWEN3_5_TEXT,
         "qwen3_vl_moe": dict(head_dim=16, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2),
         "qwen3_5_moe": dict(_QWEN3_5_TEXT, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                             num_experts=4, num_experts_per_tok=2)}
_INTERLEAVED = {"qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"}  # 3-D RoPE sections interleaved
# Qwen2.5-VL's, Qwen3-VL's, Qwen3.5's and Qwen3.6's shipped templates (the test corpus:
# tests/data/chat_templates/README.md), with the ChatML and think tokens of their tokenizer; Qwen2-VL (the session's
# tiny_qwen2_vl, whose tests read the demo's <|end|>) takes QWEN_TEMPLATE
_SHIPPED = {"qwen2_5_vl": "qwen2.5-vl.jinja", "qwen3_vl": "qwen3-vl.jinja", "qwen3_vl_moe": "qwen3-vl.jinja",
            "qwen3_5": "qwen3.5.jinja", "qwen3_5_moe": "qwen3.6.jinja"}
_CHATML_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>")


def save_qwen_vl(path: Path, family: str, *, seed: int = 0) -> Path:
    """A tiny random Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Qwen3.5 (dense or MoE) (2 vision blocks, 2 decoder
    layers), the demo tokenizer with Qwen's vision tokens, Qwen2-VL's image processor, and the template (the
    family's shipped one, and its eos <|im_end|>, but for Qwen2-VL)."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from pipeline.demo import text as demo

    config_cls, model_cls, processor_cls, vision = _QWEN_VL[family]
    tokenizer = demo.build_tokenizer()
    template = QWEN_TEMPLATE
    if family in _SHIPPED:
        tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_TOKENS + _CHATML_TOKENS),
                                      "eos_token": "<|im_end|>"})
        template = (Path(__file__).resolve().parents[1] / "data" / "chat_templates" / _SHIPPED[family]).read_text()
    else:
        tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_TOKENS)})
    tokenizer.chat_template = template
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
            **({"mrope_interleaved": True} if family in _INTERLEAVED else {})}
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    config = getattr(transformers, config_cls)(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters=rope, **_TEXT.get(family, {}), **special),
        vision_config=dict(vision, patch_size=8, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        **({} if family in _INTERLEAVED else special),
    )
    torch.manual_seed(seed)
    getattr(transformers, model_cls)(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=16 * 16, max_pixels=32 * 32, patch_size=8, merge_size=2,
                             temporal_patch_size=2).save_pretrained(path)
    (Path(path) / "processor_config.json").write_text(json.dumps({"processor_class": processor_cls}) + "\n")
    (Path(path) / "chat_template.jinja").write_text(template)
    return path


GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
GEMMA3_TEMPLATE = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<start_of_image>")


def save_gemma3(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Gemma 3 (1-layer SigLIP tower, 2 decoder layers: one sliding-window, one global) with
    its own processor: 32x32 images, 4 soft tokens each."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer, ids, special = _named_tokens_tokenizer(GEMMA3_TOKENS, GEMMA3_TEMPLATE)
    config = Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         head_dim=16, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         sliding_window=16, layer_types=["sliding_attention", "full_attention"], **special),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8),
        mm_tokens_per_image=4, boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"], **special)
    torch.manual_seed(seed)
    Gemma3ForConditionalGeneration(config).save_pretrained(path)
    Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}), tokenizer=tokenizer,
                    chat_template=GEMMA3_TEMPLATE, image_seq_length=4).save_pretrained(path)
    return path


def _named_tokens_tokenizer(named: dict[str, str], template: str, extra: tuple[str, ...] = ()):
    """The demo tokenizer with a family's image tokens as named special tokens (`tokenizer.boi_token`, ...,
    which Gemma's processors read), and `extra` tokens; returns it, the named tokens' ids and the config's
    bos / eos / pad ids."""
    from transformers import PreTrainedTokenizerFast

    from pipeline.demo import text as demo

    base = demo.build_tokenizer()
    base.add_special_tokens({"additional_special_tokens": [*named.values(), *extra]})
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, bos_token="<s>", eos_token="<|end|>",
                                        pad_token="<pad>", unk_token="<unk>", chat_template=template,
                                        model_max_length=512, extra_special_tokens=named)
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    return tokenizer, {k: tokenizer.convert_tokens_to_ids(t) for k, t in named.items()}, special


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


# Gemma 4's tokenizer attributes (its processor reads them), and its video token, which the processor adds
GEMMA4_TOKENS = {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
                 "boa_token": "<|audio>", "eoa_token": "<audio|>", "audio_token": "<|audio|>"}
GEMMA4_TEMPLATE = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<|image|>")


def save_gemma4(path: Path, *, seed: int = 0, moe: bool = False) -> Path:
    """A tiny random Gemma 4 (1-block vision tower; 2 decoder layers, one sliding-window, one global with twice
    the head size as Gemma 4's (a per-layer config), attending both ways within an image, logits soft-capped;
    `moe`: each with a mixture of 4 experts beside its MLP, the 26B-A4B's layout) with its processor's
    settings: 4x4 patches pooled 2x2, the fewest soft tokens its image processor allows (70: a 32x32 image
    is scaled to 64x64, 64 `<|image|>`s between `<|image>` and `<image|>`). Its video half needs torchvision
    to be built, so the dir is written as the processor saves it."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    tokenizer, ids, special = _named_tokens_tokenizer(GEMMA4_TOKENS, GEMMA4_TEMPLATE, extra=("<|video|>",))
    config = Gemma4Config(
        text_config=dict(vocab_size=len(tokenizer), vocab_size_per_layer_input=len(tokenizer), hidden_size=32,
                         intermediate_size=64, num_hidden_layers=2, head_dim=16, global_head_dim=32,
                         num_attention_heads=2, num_key_value_heads=1, hidden_size_per_layer_input=8,
                         max_position_embeddings=256, sliding_window=16, final_logit_softcapping=30.0,
                         layer_types=["sliding_attention", "full_attention"], use_bidirectional_attention="vision",
                         **(dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16)
                            if moe else {}), **special),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=2,
                           position_embedding_size=64),
        audio_config=None, boi_token_id=ids["boi_token"], eoi_token_id=ids["eoi_token"],
        image_token_id=ids["image_token"], video_token_id=tokenizer.convert_tokens_to_ids("<|video|>"),
        boa_token_id=ids["boa_token"], eoa_token_index=ids["eoa_token"], audio_token_id=ids["audio_token"], **special)
    torch.manual_seed(seed)
    Gemma4ForConditionalGeneration(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    image = Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
    video = dict(video_processor_type="Gemma4VideoProcessor", patch_size=4, pooling_kernel_size=2,
                 max_soft_tokens=70, do_rescale=True, rescale_factor=1 / 255, do_normalize=False)
    halves = {"image_processor": image, "feature_extractor": Gemma4AudioFeatureExtractor()}
    (Path(path) / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Gemma4Processor", "image_seq_length": 70, "video_processor": video,
         **{name: json.loads(half.to_json_string()) for name, half in halves.items()}}, indent=2) + "\n")
    (Path(path) / "chat_template.jinja").write_text(GEMMA4_TEMPLATE)
    return path


PIXTRAL_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
PIXTRAL_TEMPLATE = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "[IMG]")


def save_mistral3(path: Path, *, seed: int = 0, longest_edge: int = 24) -> Path:
    """A tiny random Mistral Small 3 (1-block Pixtral tower with 8x8 patches merged 2x2, 2 decoder layers) with
    Pixtral's processor settings and image processor, saved as Mistral's checkpoints are: the image processor's
    patch is the tower's (8), the processor's `spatial_merge_size` (2) makes its image tokens 16x16 pixels.
    Images are scaled to `longest_edge` (a 32x32 one to 24x24) and padded to whole 16-pixel tokens by the
    processor: 2x2 `[IMG]`s with an `[IMG_BREAK]` after each row, the last one `[IMG_END]`."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    from pipeline.demo import text as demo

    tokenizer = demo.build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(PIXTRAL_TOKENS)})
    tokenizer.chat_template = PIXTRAL_TEMPLATE
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    config = Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, head_dim=16, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256, **special),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           head_dim=8, image_size=64, patch_size=8),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2, **special)
    torch.manual_seed(seed)
    Mistral3ForConditionalGeneration(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    PixtralImageProcessorPil(size={"longest_edge": longest_edge}, patch_size={"height": 8, "width": 8}
                             ).save_pretrained(path)
    (Path(path) / "processor_config.json").write_text(json.dumps(
        {"processor_class": "PixtralProcessor", "patch_size": 8, "spatial_merge_size": 2, "image_token": "[IMG]",
         "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}, indent=2) + "\n")
    (Path(path) / "chat_template.jinja").write_text(PIXTRAL_TEMPLATE)
    return path


LLAMA4_TOKENS = ("<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
                 "<|tile_y_separator|>")
LLAMA4_TEMPLATE = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<|image|>")


def save_llama4(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Llama 4 (1-block vision tower with 8x8 patches on 16x16 tiles, pixel shuffle 0.5; 2 decoder
    layers, the second a mixture of 4 experts stored fused, Llama 4's layout) with Llama 4's processor
    settings. Its image processor exists only for torchvision; it is saved as the processor would save it."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    from pipeline.demo import text as demo

    tokenizer = demo.build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(LLAMA4_TOKENS)})
    tokenizer.chat_template = LLAMA4_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in LLAMA4_TOKENS}
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    config = Llama4Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=16, intermediate_size_mlp=64,
                         num_hidden_layers=2, head_dim=16, num_attention_heads=2, num_key_value_heads=1,
                         num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                         max_position_embeddings=256, attention_chunk_size=64, **special),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8, pixel_shuffle_ratio=0.5, vision_output_dim=16,
                           projector_input_dim=32, projector_output_dim=32),
        boi_token_index=ids["<|image_start|>"], eoi_token_index=ids["<|image_end|>"],
        image_token_index=ids["<|patch|>"])
    torch.manual_seed(seed)
    Llama4ForConditionalGeneration(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    image = dict(image_processor_type="Llama4ImageProcessor", size={"height": 16, "width": 16}, max_patches=4,
                 resize_to_max_canvas=False, do_resize=True, do_rescale=True, rescale_factor=1 / 255,
                 do_normalize=True, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], do_convert_rgb=True)
    (Path(path) / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Llama4Processor", "patch_size": 8, "pixel_shuffle_ratio": 0.5, "image_processor": image},
        indent=2) + "\n")
    (Path(path) / "chat_template.jinja").write_text(LLAMA4_TEMPLATE)
    return path
def _family_tokenizer(specials: list[str], *, bos: str | None, eos: str, template: str, named: dict | None = None,
                      adds_bos: bool = False):
    """The demo's character tokenizer with a family's special tokens, its bos / eos and chat template;
    `named`: extra special tokens the family's processor reads by attribute (`tokenizer.image_token`, ...);
    `adds_bos`: encoding with special tokens opens with the bos, as Llama's and Mistral's tokenizers do."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    from pipeline.demo import text as demo

    base = demo.build_tokenizer()
    base.add_special_tokens({"additional_special_tokens": [t for t in specials if t not in base.get_vocab()]})
    if adds_bos:
        base.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, base.convert_tokens_to_ids(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, bos_token=bos, eos_token=eos,
                                   pad_token="<pad>", unk_token="<unk>", chat_template=template, model_max_length=512,
                                   **({"extra_special_tokens": named} if named else {}))


def _text_config(tokenizer, **extra) -> dict:
    """A 2-layer, 32-wide decoder's settings for `tokenizer`, as a composite config's `text_config`."""
    return dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, **extra)


def _save_parts(path: Path, model, tokenizer, image_processor, template: str, processor_class: str, **settings):
    """A model dir whose processor is written as its parts (tokenizer, image processor, processor_config.json,
    chat_template.jinja), as a hub checkpoint holds it: for processors that cannot be built here (a video
    half that needs torchvision)."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    image_processor.save_pretrained(path)
    (Path(path) / "processor_config.json").write_text(json.dumps({"processor_class": processor_class, **settings}) + "\n")
    (Path(path) / "chat_template.jinja").write_text(template)
    return path


# SmolVLM2's chat template, verbatim: transformers' SmolVLMProcessor DEFAULT_CHAT_TEMPLATE
# (models/smolvlm/processing_smolvlm.py, 5.24), the template of HuggingFaceTB/SmolVLM2-*-Instruct.
SMOLVLM_TEMPLATE = "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'] is string %}{{': ' + message['content']}}{% else %}{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}{% elif line['type'] == 'image' %}{{ '<image>' }}{% elif line['type'] == 'video' %}{{ '<video>' }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"  # noqa: E501
# Idefics3's, verbatim: TRL's trl/chat_templates/idefics3.jinja (content only as a list of parts)
IDEFICS3_TEMPLATE = "<|begin_of_text|>{% for message in messages %}{{message['role'].capitalize()}}{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"  # noqa: E501
_IDEFICS_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>", "<video>",
                   *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]


def save_smolvlm(path: Path, *, family: str = "smolvlm", seed: int = 0) -> Path:
    """A tiny random SmolVLM2 (`SmolVLMForConditionalGeneration`) or Idefics3 (`family="idefics3"`): a 1-layer
    SigLIP-style tower on 32x32 tiles (8x8 patches, pixel shuffle 2: 4 `<image>` tokens a tile), 2 Llama layers.

    SmolVLM2 splits an image: a 32x32 image is resized to 64x64 and cut into 2x2 tiles plus the whole image,
    each written as `<fake_token_around_image>`, `<row_r_col_c>` (or `<global-img>`) and its 4 `<image>`
    tokens. Idefics3 keeps an image whole (`do_image_splitting=False`). Its processor is written as parts:
    SmolVLM's video processor needs torchvision."""
    import transformers
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    smol = family == "smolvlm"
    template = SMOLVLM_TEMPLATE if smol else IDEFICS3_TEMPLATE
    bos = "<|im_start|>" if smol else "<|begin_of_text|>"
    tokenizer = _family_tokenizer([bos, *_IDEFICS_TOKENS], bos=bos, eos="<end_of_utterance>", template=template)
    config = getattr(transformers, "SmolVLMConfig" if smol else "Idefics3Config")(
        text_config=_text_config(tokenizer, model_type="llama"),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8),
        scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"), pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = getattr(transformers, "SmolVLMForConditionalGeneration" if smol else "Idefics3ForConditionalGeneration")(
        config)
    # the PIL backend by name: the same pixels with or without torchvision installed here
    images = SmolVLMImageProcessorPil(size={"longest_edge": 64 if smol else 32}, max_image_size={"longest_edge": 32},
                                      do_image_splitting=smol)
    return _save_parts(path, model, tokenizer, images, template, "SmolVLMProcessor" if smol else "Idefics3Processor",
                       image_seq_len=4)


# InternVL3's -hf chat template, verbatim: the `chat_template` transformers' converter writes into the -hf
# checkpoints (models/internvl/convert_internvl_weights_to_hf.py); it writes the processor's <IMG_CONTEXT>
INTERNVL_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}"
    "{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}"
    "{{ '<video>\n' }}"
    "{% elif content['type'] == 'text' %}"
    "{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{'<|im_end|>\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{'<|im_start|>assistant\n' }}"
    "{% endif %}"
)
INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                   "video_token": "<video>"}


def save_internvl(path: Path, *, seed: int = 0) -> Path:
    """A tiny random InternVL3 (`InternVLForConditionalGeneration`: a 1-layer InternViT on 32x32 images, 8x8
    patches, pixel shuffle 0.5: `<img>`, 4 `<IMG_CONTEXT>`, `</img>` an image; 2 Qwen2 layers), GOT-OCR2's
    image processor (one 32x32 tile). Its processor is written as parts: the video processor needs torchvision."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    tokenizer = _family_tokenizer(["<|im_start|>", "<|im_end|>", *INTERNVL_TOKENS.values()], bos=None,
                                  eos="<|im_end|>", template=INTERNVL_TEMPLATE, named=INTERNVL_TOKENS)
    config = InternVLConfig(
        text_config=_text_config(tokenizer, model_type="qwen2"),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=[32, 32], patch_size=[8, 8]),
        image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"), downsample_ratio=0.5,
        vision_feature_layer=-1, vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    images = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, max_patches=1)
    return _save_parts(path, InternVLForConditionalGeneration(config), tokenizer, images, INTERNVL_TEMPLATE,
                       "InternVLProcessor", image_seq_length=4)


# LLaVA-NeXT's (llava-v1.6-mistral), verbatim: TRL's trl/chat_templates/llava_next.jinja (content only as parts)
LLAVA_NEXT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ '<<SYS>>\n' + message['content'][0]['text'] + "
    "'\n<</SYS>>\n\n' }}{% elif message['role'] == 'user' %}{{ '[INST] ' }}{# Render all images first #}{% for content "
    "in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}{# Render all text "
    "next #}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] }}"
    "{% endfor %}{{' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'][0]['text'] + "
    "'</s> '}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
# anyres: a 32x32 image takes the 32x32 grid, 2x2 tiles of 16x16 plus the whole image resized
LLAVA_NEXT_PINPOINTS = [[16, 32], [32, 16], [32, 32]]


def save_llava_next(path: Path, *, seed: int = 0, granite: bool = False) -> Path:
    """A tiny random LLaVA-NeXT (`LlavaNextForConditionalGeneration`: a 1-layer CLIP tower on 16x16 tiles,
    8x8 patches, 2 Llama layers) with its own processor: anyres, so a 32x32 image is the whole image
    (4 features) plus a 2x2 grid of tiles, unpadded with a newline per row (4 x 4 + 4): 24 `<image>`.
    `granite`: Granite Vision's layout, a Granite text model (its `logits_scaling`, 8 here, which the
    composite's forward leaves out) in the same composite."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    # Mistral's tokenizer opens a sequence with <s>, which the template does not write: the processor adds it
    tokenizer = _family_tokenizer(["<image>", "[INST]", "[/INST]", "</s>"], bos="<s>", eos="</s>",
                                  template=LLAVA_NEXT_TEMPLATE, adds_bos=True)
    config = LlavaNextConfig(
        text_config=_text_config(tokenizer, **({"model_type": "granite", "logits_scaling": 8.0} if granite
                                               else {"model_type": "llama"})),
        vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=16, patch_size=8, projection_dim=16),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"), image_grid_pinpoints=LLAVA_NEXT_PINPOINTS,
        vision_feature_select_strategy="default", vision_feature_layer=-1, image_seq_length=4)
    torch.manual_seed(seed)
    LlavaNextForConditionalGeneration(config).save_pretrained(path)
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16},
                                        image_grid_pinpoints=LLAVA_NEXT_PINPOINTS)
    LlavaNextProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default",
                       num_additional_image_tokens=1, chat_template=LLAVA_NEXT_TEMPLATE).save_pretrained(path)
    return path


LFM2_VL_TOKENS = ["<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>", "<|im_start|>", "<|im_end|>"]


def save_lfm2_vl(path: Path, *, seed: int = 0) -> Path:
    """A tiny random LFM2-VL (`Lfm2VlForConditionalGeneration`: a 1-layer SigLIP2 tower, 2 LFM2 layers, one
    convolution and one attention) whose processor is written as parts. Its image processor exists only for
    torchvision (no PIL backend in transformers), so without torchvision the pipeline refuses it by name."""
    from transformers import Lfm2VlConfig, Lfm2VlForConditionalGeneration

    tokenizer = _family_tokenizer(LFM2_VL_TOKENS, bos="<s>", eos="<|im_end|>", template=INTERNVL_TEMPLATE.replace(
        "<IMG_CONTEXT>", "<image>"))
    config = Lfm2VlConfig(
        text_config=_text_config(tokenizer, model_type="lfm2", layer_types=["conv", "full_attention"]),
        vision_config=dict(model_type="siglip2_vision_model", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, patch_size=8, num_patches=16),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), projector_hidden_size=32)
    torch.manual_seed(seed)
    Lfm2VlForConditionalGeneration(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    # what Lfm2VlImageProcessor.save_pretrained writes, by hand: the class cannot be built without torchvision
    (Path(path) / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Lfm2VlImageProcessor", "do_image_splitting": False, "encoder_patch_size": 8,
         "min_image_tokens": 4, "max_image_tokens": 16, "downsample_factor": 2}) + "\n")
    (Path(path) / "processor_config.json").write_text(json.dumps({"processor_class": "Lfm2VlProcessor"}) + "\n")
    return path


# GLM-4.1V's turn format (role markers, `[gMASK]<sop>`, an image as `<|begin_of_image|><|image|><|end_of_image|>`,
# a turn ended by the next one's marker), as vLLM's GLM-4.1V example prompt writes it. Not the shipped template:
# no verbatim copy of it is at hand here.
GLM4V_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|begin_of_image|><|image|><|end_of_image|>' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
GLM4V_TOKENS = ["[gMASK]", "<sop>", "<|endoftext|>", "<|begin_of_image|>", "<|image|>", "<|end_of_image|>",
                "<|begin_of_video|>", "<|video|>", "<|end_of_video|>"]


def _glm_vision(ids: dict, **vision) -> dict:
    """What a GLM-4.1V-style composite config takes beside its text config: its tower (2 blocks, 8x8 patches merged
    2x2, `vision` on top) and its image / video token ids (`ids`: GLM4V_TOKENS -> id)."""
    return dict(
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           image_size=32, patch_size=8, spatial_merge_size=2, temporal_patch_size=2, **vision),
        image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"], video_end_token_id=ids["<|end_of_video|>"])


def _glm_images(image_processor_class):
    """A GLM-4.1V-style PIL image processor for the tower of `_glm_vision`: a 32x32 image is 4 tokens."""
    # its pixel bounds count the 2 frames an image is repeated into
    return image_processor_class(size={"shortest_edge": 2 * 16 * 16, "longest_edge": 2 * 32 * 32}, patch_size=8,
                                 merge_size=2, temporal_patch_size=2)


def save_glm4v(path: Path, *, seed: int = 0, moe: bool = False) -> Path:
    """A tiny random GLM-4.1V (`Glm4vForConditionalGeneration`: 2 vision blocks, 8x8 patches, 2x2 merge: a
    32x32 image is 4 `<|image|>` tokens with `image_grid_thw`; 2 decoder layers with 3-D RoPE), GLM-4.1V's
    image processor; the processor is written as parts (its video processor needs torchvision). `moe`: GLM-4.5V
    (`Glm4vMoeForConditionalGeneration`, GLM-4.1V's composite and processor): the second decoder layer a mixture
    of 4 routed experts stored fused and a shared expert, GLM-4.5's layout."""
    import transformers
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    tokenizer = _family_tokenizer(GLM4V_TOKENS, bos=None, eos="<|endoftext|>", template=GLM4V_TEMPLATE)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GLM4V_TOKENS}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2], "partial_rotary_factor": 0.5}
    moe_text = dict(moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                    first_k_dense_replace=1, n_group=1, topk_group=1)
    config = getattr(transformers, "Glm4vMoeConfig" if moe else "Glm4vConfig")(
        text_config=_text_config(tokenizer, rope_parameters=rope, **(moe_text if moe else {})), **_glm_vision(ids))
    torch.manual_seed(seed)
    images = _glm_images(Glm4vImageProcessorPil)
    model = getattr(transformers, "Glm4vMoeForConditionalGeneration" if moe else "Glm4vForConditionalGeneration")
    return _save_parts(path, model(config), tokenizer, images, GLM4V_TEMPLATE, "Glm4vProcessor")


def save_paligemma(path: Path, *, seed: int = 0) -> Path:
    """A tiny random PaliGemma 2 (`PaliGemmaForConditionalGeneration`: a 1-layer SigLIP tower on 32x32 images,
    16x16 patches: 4 `<image>` tokens an image; 2 Gemma 2 layers) with its own processor, which adds `<image>`
    and its location / segmentation tokens to the tokenizer and, as the shipped checkpoints, has no chat
    template: a prompt is `<image>`s, the bos, the prompt and a newline; the answer its `suffix`."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration, PaliGemmaProcessor
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    tokenizer = _family_tokenizer([], bos="<s>", eos="<|end|>", template=None)
    images = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    images.image_seq_length = 4
    processor = PaliGemmaProcessor(image_processor=images, tokenizer=tokenizer)
    config = PaliGemmaConfig(
        text_config=_text_config(tokenizer, model_type="gemma2", head_dim=16),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=16, projection_dim=32),
        image_token_index=processor.image_token_id, projection_dim=32)
    torch.manual_seed(seed)
    PaliGemmaForConditionalGeneration(config).save_pretrained(path)
    processor.save_pretrained(path)
    return path


MLLAMA_TEMPLATE = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<|image|>")


def save_mllama(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Llama 3.2 Vision (`MllamaForConditionalGeneration`: a 1+1-layer tower on up to 2 tiles of
    16x16, 8x8 patches; 2 decoder layers, the second a cross-attention layer over the image features) with its
    own processor: an image stays one `<|image|>` in the text, and the text attends the image through
    cross-attention (`cross_attention_mask`, `aspect_ratio_ids`)."""
    from transformers import MllamaConfig, MllamaForConditionalGeneration, MllamaProcessor
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    tokenizer = _family_tokenizer(["<|image|>"], bos="<s>", eos="<|end|>", template=MLLAMA_TEMPLATE)
    config = MllamaConfig(
        text_config=_text_config(tokenizer, cross_attention_layers=[1]),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_global_layers=1,
                           attention_heads=2, image_size=16, patch_size=8, max_num_tiles=2,
                           intermediate_layers_indices=[0], vision_output_dim=32,
                           supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]]),
        image_token_index=tokenizer.convert_tokens_to_ids("<|image|>"))
    torch.manual_seed(seed)
    MllamaForConditionalGeneration(config).save_pretrained(path)
    images = MllamaImageProcessorPil(size={"height": 16, "width": 16}, max_image_tiles=2)
    MllamaProcessor(image_processor=images, tokenizer=tokenizer, chat_template=MLLAMA_TEMPLATE).save_pretrained(path)
    return path


# LLaVA-OneVision's turns (Qwen2's ChatML, an image as `<image>` and a newline before the text): not the shipped
# template, no verbatim copy of which is at hand here
LLAVA_ONEVISION_TEMPLATE = INTERNVL_TEMPLATE.replace("<IMG_CONTEXT>", "<image>")


def save_llava_onevision(path: Path, *, seed: int = 0) -> Path:
    """A tiny random LLaVA-OneVision (`LlavaOnevisionForConditionalGeneration`: a 1-layer SigLIP tower on 16x16
    tiles, 8x8 patches; 2 Qwen2 layers) with its processor's settings: anyres, a 32x32 image is the whole image
    (4 features) and a 2x2 grid of tiles with a newline per row (4 x 4 + 2), 22 `<image>`s. Its processor is
    written as parts (its video processor needs torchvision)."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    tokenizer = _family_tokenizer(["<|im_start|>", "<|im_end|>", "<image>", "<video>"], bos=None, eos="<|im_end|>",
                                  template=LLAVA_ONEVISION_TEMPLATE)
    config = LlavaOnevisionConfig(
        text_config=_text_config(tokenizer, model_type="qwen2"),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_index=tokenizer.convert_tokens_to_ids("<video>"), image_grid_pinpoints=LLAVA_NEXT_PINPOINTS,
        vision_feature_select_strategy="full", vision_feature_layer=-1)
    torch.manual_seed(seed)
    images = LlavaOnevisionImageProcessorPil(size={"height": 16, "width": 16}, image_grid_pinpoints=LLAVA_NEXT_PINPOINTS)
    return _save_parts(path, LlavaOnevisionForConditionalGeneration(config), tokenizer, images,
                       LLAVA_ONEVISION_TEMPLATE, "LlavaOnevisionProcessor", num_image_tokens=4,
                       vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9")


def save_idefics2(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Idefics2 (`Idefics2ForConditionalGeneration`: a 1-layer SigLIP-style tower on 32x32 images,
    8x8 patches, a 1-layer perceiver to 4 latents; 2 Mistral layers) with its own processor (images kept whole:
    `<fake_token_around_image>`, 4 `<image>`, `<fake_token_around_image>`), which expands the image tokens inside
    its own call."""
    from transformers import Idefics2Config, Idefics2ForConditionalGeneration, Idefics2Processor
    from transformers.models.idefics2.image_processing_pil_idefics2 import Idefics2ImageProcessorPil

    tokenizer = _family_tokenizer(["<|begin_of_text|>", *_IDEFICS_TOKENS], bos="<|begin_of_text|>",
                                  eos="<end_of_utterance>", template=IDEFICS3_TEMPLATE)
    config = Idefics2Config(
        text_config=_text_config(tokenizer, model_type="mistral"),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8),
        perceiver_config=dict(hidden_size=32, resampler_n_latents=4, resampler_depth=1, resampler_n_heads=2,
                              resampler_head_dim=8, num_key_value_heads=1),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(seed)
    Idefics2ForConditionalGeneration(config).save_pretrained(path)
    images = Idefics2ImageProcessorPil(do_image_splitting=False, size={"longest_edge": 32, "shortest_edge": 32})
    Idefics2Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4,
                      chat_template=IDEFICS3_TEMPLATE).save_pretrained(path)
    return path


# Aya Vision's turns (Command R's turn tokens, an image as the processor's `<image>`): not the shipped template,
# no verbatim copy of which is at hand here
AYA_VISION_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|START_OF_TURN_TOKEN|>' + ('<|USER_TOKEN|>' if message['role'] == 'user' else '<|CHATBOT_TOKEN|>') }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|END_OF_TURN_TOKEN|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{% endif %}"
)
AYA_VISION_TOKENS = ["<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>",
                     "<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>",
                     "TILE_GLOBAL", *(f"TILE_{k}" for k in range(1, 5))]


def _cohere_vision_parts(named: dict | None = None):
    """Aya Vision's and Command A Vision's tokenizer (Command R's turn tokens, `named`: the tokens the processor
    reads by attribute) and their common settings: a 1-layer SigLIP tower on 32x32 tiles, 8x8 patches, pixel
    shuffle 2; 2 Cohere 2 layers, one sliding-window, one global."""
    tokenizer = _family_tokenizer(["<BOS_TOKEN>", *AYA_VISION_TOKENS], bos="<BOS_TOKEN>",
                                  eos="<|END_OF_TURN_TOKEN|>", template=AYA_VISION_TEMPLATE, named=named)
    return tokenizer, dict(
        text_config=_text_config(tokenizer, model_type="cohere2", head_dim=16,
                                 layer_types=["sliding_attention", "full_attention"], sliding_window=16),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8),
        downsample_factor=2)


def save_aya_vision(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Aya Vision (`AyaVisionForConditionalGeneration`: a 1-layer SigLIP tower on 32x32 tiles, 8x8
    patches, pixel shuffle 2; 2 Cohere 2 layers) with its own processor and GOT-OCR2's image processor (one
    tile): an image is `<|START_OF_IMG|>`, `TILE_GLOBAL`, 4 `<|IMG_PATCH|>` and `<|END_OF_IMG|>`."""
    from transformers import AyaVisionConfig, AyaVisionForConditionalGeneration, AyaVisionProcessor
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    tokenizer, parts = _cohere_vision_parts()
    config = AyaVisionConfig(**parts, image_token_index=tokenizer.convert_tokens_to_ids("<|IMG_PATCH|>"),
                             vision_feature_layer=-1)
    torch.manual_seed(seed)
    AyaVisionForConditionalGeneration(config).save_pretrained(path)
    images = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, max_patches=1)
    AyaVisionProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8, img_size=32, downsample_factor=2,
                       chat_template=AYA_VISION_TEMPLATE).save_pretrained(path)
    return path


def save_lfm3_vl(path: Path, *, seed: int = 0) -> Path:
    """A tiny random LFM3-VL (`Lfm3VlForConditionalGeneration`: a 2-layer tower, a convolution and an attention
    layer, on 8x8 patches merged 2x2; 2 LFM3 layers, a convolution and an attention layer) with Qwen2-VL's image
    processor (PIL backend), as LFM3-VL ships: a 32x32 image is 4 `<|image_pad|>`s between `<|vision_start|>` and
    `<|vision_end|>`. Its processor is written as parts (its video processor needs torchvision)."""
    from transformers import Lfm3VlConfig, Lfm3VlForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = _family_tokenizer(list(QWEN_TOKENS), bos="<s>", eos="<|end|>", template=QWEN_TEMPLATE)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
    config = Lfm3VlConfig(
        text_config=_text_config(tokenizer, model_type="lfm3", head_dim=16, layer_types=["conv", "full_attention"]),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=2, patch_size=8, spatial_merge_size=2, temporal_patch_size=2,
                           layer_types=["conv", "full_attention"]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        projector_hidden_size=32)
    torch.manual_seed(seed)
    images = Qwen2VLImageProcessorPil(min_pixels=16 * 16, max_pixels=32 * 32, patch_size=8, merge_size=2,
                                      temporal_patch_size=2)
    return _save_parts(path, Lfm3VlForConditionalGeneration(config), tokenizer, images, QWEN_TEMPLATE,
                       "Lfm3VlProcessor")


def _save_without_image_processor(path: Path, model, tokenizer, image_processor: dict, template: str,
                                  processor_class: str) -> Path:
    """A model dir whose image processor exists only for torchvision: its `preprocessor_config.json` written as
    the class saves it, by hand (the class cannot be built without torchvision). `model` None: a config alone
    (a tower that needs a package not installed here cannot be built): its config is saved."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (Path(path) / "preprocessor_config.json").write_text(json.dumps(image_processor) + "\n")
    (Path(path) / "processor_config.json").write_text(json.dumps({"processor_class": processor_class}) + "\n")
    (Path(path) / "chat_template.jinja").write_text(template)
    return path


COHERE2_VISION_TOKENS = {"image_token": "<|IMG_PATCH|>", "boi_token": "<|START_OF_IMG|>",
                         "eoi_token": "<|END_OF_IMG|>", "img_line_break_token": "<|IMG_LINE_BREAK|>"}


def save_cohere2_vision(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Command A Vision (`Cohere2VisionForConditionalGeneration`: a 1-layer SigLIP tower on 32x32
    tiles, pixel shuffle 2; 2 Cohere 2 layers). Its image processor exists only for torchvision."""
    from transformers import Cohere2VisionConfig, Cohere2VisionForConditionalGeneration

    tokenizer, parts = _cohere_vision_parts(named=COHERE2_VISION_TOKENS)
    config = Cohere2VisionConfig(**parts, image_token_id=tokenizer.convert_tokens_to_ids("<|IMG_PATCH|>"),
                                 alignment_intermediate_size=32)
    torch.manual_seed(seed)
    image = {"image_processor_type": "Cohere2VisionImageProcessor", "size": {"height": 32, "width": 32},
             "max_patches": 1, "patch_size": 8}
    return _save_without_image_processor(path, Cohere2VisionForConditionalGeneration(config), tokenizer, image,
                                         AYA_VISION_TEMPLATE, "Cohere2VisionProcessor")


def save_kimi_k25(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Kimi K2.5 (`Kimi_K25ForConditionalGeneration`: a 1-layer MoonViT tower, 8x8 patches merged
    2x2; 2 DeepSeek-V3 layers, the second 4 routed experts and a shared one). Its image processor exists only for
    torchvision."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    tokens = ["<|media_begin|>", "<|media_end|>", "<|media_pad|>", "<|video_pad|>"]
    tokenizer = _family_tokenizer(tokens, bos="<s>", eos="<|end|>", template=QWEN_TEMPLATE.replace(
        "<|vision_start|><|image_pad|><|vision_end|>", "<|media_begin|><|media_pad|><|media_end|>"))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in tokens}
    config = Kimi_K25Config(
        text_config=_text_config(tokenizer, model_type="deepseek_v3", moe_intermediate_size=16, n_routed_experts=4,
                                 num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                                 topk_group=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                                 qk_nope_head_dim=8, v_head_dim=16),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           patch_size=8, pos_emb_height=8, pos_emb_width=8),
        projection_hidden_size=32, image_token_id=ids["<|media_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|media_begin|>"], vision_end_token_id=ids["<|media_end|>"])
    torch.manual_seed(seed)
    image = {"image_processor_type": "Kimi_K25ImageProcessor", "size": {"max_height": 32, "max_width": 32},
             "patch_size": 8, "merge_size": 2}
    return _save_without_image_processor(path, Kimi_K25ForConditionalGeneration(config), tokenizer, image,
                                         QWEN_TEMPLATE, "Kimi_K25Processor")


GEMMA3N_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>",
                  "boa_token": "<start_of_audio>", "eoa_token": "<end_of_audio>", "audio_token": "<audio_soft_token>"}


def save_gemma3n(path: Path) -> Path:
    """A Gemma 3n dir (`Gemma3nForConditionalGeneration`) as its processor saves it (SigLIP's PIL image processor,
    its audio feature extractor, 4 soft tokens an image) with a tiny config only: its vision tower is a timm
    model (`TimmWrapperModel`), which cannot be built without timm, not installed here."""
    from transformers import Gemma3nConfig, Gemma3nProcessor
    from transformers.models.gemma3n.feature_extraction_gemma3n import Gemma3nAudioFeatureExtractor
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    tokenizer, ids, special = _named_tokens_tokenizer(GEMMA3N_TOKENS, GEMMA3_TEMPLATE)
    config = Gemma3nConfig(
        text_config=dict(vocab_size=len(tokenizer), vocab_size_per_layer_input=len(tokenizer), hidden_size=32,
                         intermediate_size=64, num_hidden_layers=2, head_dim=16, num_attention_heads=2,
                         num_key_value_heads=1, hidden_size_per_layer_input=8, max_position_embeddings=256,
                         sliding_window=16, layer_types=["sliding_attention", "full_attention"], **special),
        boi_token_id=ids["boi_token"], eoi_token_id=ids["eoi_token"], image_token_id=ids["image_token"],
        boa_token_id=ids["boa_token"], eoa_token_id=ids["eoa_token"], audio_token_id=ids["audio_token"],
        vision_soft_tokens_per_image=4)
    config.save_pretrained(path)
    Gemma3nProcessor(feature_extractor=Gemma3nAudioFeatureExtractor(),
                     image_processor=SiglipImageProcessorPil(size={"height": 32, "width": 32}), tokenizer=tokenizer,
                     chat_template=GEMMA3_TEMPLATE, image_seq_length=4, audio_seq_length=4).save_pretrained(path)
    return path


def save_perception_lm(path: Path) -> Path:
    """A PerceptionLM dir (`PerceptionLMForConditionalGeneration`) with a tiny config only: its vision tower is a
    timm model, which cannot be built without timm, and its image processor exists only for torchvision (its
    `preprocessor_config.json` written by hand)."""
    from transformers import PerceptionLMConfig

    tokens = ["<|image|>", "<|video|>"]
    template = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<|image|>")
    tokenizer = _family_tokenizer(tokens, bos="<s>", eos="<|end|>", template=template)
    config = PerceptionLMConfig(
        text_config=_text_config(tokenizer, model_type="llama"),
        vision_config=dict(model_type="timm_wrapper", architecture="vit_pe_core_tiny_patch16_384", num_classes=0,
                           model_args={"embed_dim": 16, "depth": 1, "num_heads": 2, "img_size": [32, 32]}),
        image_token_id=tokenizer.convert_tokens_to_ids("<|image|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video|>"))
    image = {"image_processor_type": "PerceptionLMImageProcessor", "tile_size": 32, "max_num_tiles": 1,
             "vision_input_type": "thumb+tile"}
    return _save_without_image_processor(path, config, tokenizer, image, template, "PerceptionLMProcessor")
