"""The embedded vision-language default: a tiny LLaVA-style model, its processor and a demo dataset.

Nothing is downloaded; like `pipeline.demo.text`, `prepare_base` writes real Hugging
Face directories (`save_pretrained`), which `AutoModelForImageTextToText` and
`AutoProcessor` load, so the whole DAG runs through the code a real LLaVA takes.

The model: a 2-layer CLIP vision tower on 32x32 images (8x8 patches: 16 image
tokens), LLaVA's two-layer projector, and the demo's Llama-style language model
(`pipeline.demo.build_model`, smaller) with the demo's character tokenizer plus
an ``<image>`` token. The images are drawn on the fly: one coloured shape
(circle, square or triangle, of random size and place) on a dark background.

Why a pre-trained base, as in the text demo: the base learns to *see* first. It
is pre-trained on raw captions, ``<image>red circle``, tower and projector and
language model together (about 300 steps). The SFT task asks a question in
the chat format it has never seen ("what color is the shape?") and expects the
colour alone: the base answers with a caption or noise (exact match ~0), LoRA
on the language model plus the projector trained in full learn the format and
the question (exact match ~1 after a hundred updates).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from pipeline.demo import text as demo
from pipeline.data.cache import IGNORE_INDEX
from pipeline.data.formats import IMAGE_PLACEHOLDER


IMAGE_SIZE = 32
PATCH = 8
COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 230), "yellow": (230, 210, 40),
          "white": (240, 240, 240)}
SHAPES = ("circle", "square", "triangle")
QUESTIONS = ("what color is the shape?", "which color is it?", "name the color of the shape.")
CAPTION = "{color} {shape}"  # the base's pre-training text after the image

# The demo template, with content parts: an image part is the image token, where it stands.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '" + IMAGE_PLACEHOLDER + "' }}{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def draw(rng: random.Random, color: str, shape: str):
    """A 32x32 RGB image: one `shape` in `color`, random size and place, on a random dark background."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), tuple(rng.randint(0, 40) for _ in range(3)))
    pen = ImageDraw.Draw(image)
    r = rng.randint(8, 12)
    cx, cy = rng.randint(r, IMAGE_SIZE - r - 1), rng.randint(r, IMAGE_SIZE - r - 1)
    fill = COLORS[color]
    if shape == "circle":
        pen.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        s = round(r * 0.8)  # about the circle's area
        pen.rectangle([cx - s, cy - s, cx + s, cy + s], fill=fill)
    else:
        pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return image


def build_tokenizer():
    """The demo tokenizer plus the image token, with a chat template that takes content parts."""
    tokenizer = demo.build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_PLACEHOLDER]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_processor(tokenizer):
    """LLaVA's processor: CLIP preprocessing to 32x32, 16 image tokens per image (CLS dropped)."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    # The PIL backend by name: the same pixels with or without torchvision installed here.
    images = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                   crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=CHAT_TEMPLATE)


def build_model(tokenizer, *, vision_hidden=64, vision_layers=2, hidden=64, layers=2, heads=4, seed=0):
    """A random-init LLaVA: CLIP vision tower, projector, the demo's Llama-style language model."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    text = demo.build_model(tokenizer, hidden=hidden, layers=layers, heads=heads, intermediate=2 * hidden,
                            seed=seed).config
    vision = CLIPVisionConfig(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                              num_hidden_layers=vision_layers, num_attention_heads=2, image_size=IMAGE_SIZE,
                              patch_size=PATCH, projection_dim=vision_hidden)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER),
                         image_seq_length=(IMAGE_SIZE // PATCH) ** 2, vision_feature_layer=-1,
                         vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(config)


def _captions(processor, rng: random.Random, n: int):
    """n (image, caption) pairs as a training batch: labels on the caption and end token only."""
    images, texts = [], []
    for _ in range(n):
        color, shape = rng.choice(list(COLORS)), rng.choice(SHAPES)
        images.append(draw(rng, color, shape))
        texts.append(processor.tokenizer.bos_token + IMAGE_PLACEHOLDER + CAPTION.format(color=color, shape=shape)
                     + processor.tokenizer.eos_token)
    batch = processor(images=images, text=texts, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
    labels = labels.masked_fill(batch["input_ids"] == processor.image_token_id, IGNORE_INDEX)
    return batch, labels


def pretrain(model, processor, *, steps=300, batch=32, lr=3e-3, seed=0) -> dict:
    """Teach the whole base to caption; returns its held-out colour accuracy from the caption."""
    seconds = demo.train_from_scratch(model, lambda rng: _captions(processor, rng, batch), steps=steps, lr=lr,
                                      seed=seed)
    rng = random.Random(10_000)
    refs = [(rng.choice(list(COLORS)), rng.choice(SHAPES)) for _ in range(64)]
    tokenizer = processor.tokenizer
    inputs = processor(images=[draw(rng, c, s) for c, s in refs], text=[tokenizer.bos_token + IMAGE_PLACEHOLDER] * 64,
                       return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    captions = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    colors = sum(text.split(" ")[0] == color for text, (color, _) in zip(captions, refs)) / len(refs)
    return {"steps": steps, "seconds": seconds, "caption_color_accuracy": colors}


def record(idx: int, split: str, image: str, color: str, question: str, *, openai: bool) -> dict:
    """One image question: LLaVA `conversations` (placeholder in the text) or OpenAI content parts."""
    if openai:
        return {"id": f"{split}-{idx:05d}", "messages": [
            {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "\n" + question}]},
            {"role": "assistant", "content": color},
        ]}
    return {"id": f"{split}-{idx:05d}", "image": image, "conversations": [
        {"from": "human", "value": f"{IMAGE_PLACEHOLDER}\n{question}"},
        {"from": "gpt", "value": color},
    ]}


def build_dataset(out_dir: Path, *, n_train=1000, n_val=64, n_test=64, seed=1) -> dict[str, Path]:
    """train / val / held-out test splits of the colour question, each record with its own image file.

    train and val are LLaVA records, test uses OpenAI content parts (both formats
    go through the same code). Images go to `out_dir/images/`, named by split
    and record; the records refer to them relative to the dataset file.
    """
    rng = random.Random(seed)
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n in (("train", n_train), ("val", n_val), ("test", n_test)):
        path = out_dir / f"{split}.jsonl"
        with path.open("w") as f:
            for i in range(n):
                color, shape = rng.choice(list(COLORS)), rng.choice(SHAPES)
                image = f"images/{split}-{i:05d}.png"
                draw(rng, color, shape).save(out_dir / image)
                f.write(json.dumps(record(i, split, image, color, rng.choice(QUESTIONS), openai=split == "test")) + "\n")
        paths[split] = path
    return paths


def prepare_base(model_dir: Path, data_dir: Path, *, pretrain_steps: int = 300, seed: int = 0) -> dict:
    """Build, pre-train and save the embedded vision-language base and its demo dataset."""
    tokenizer = build_tokenizer()
    processor = build_processor(tokenizer)
    model = build_model(tokenizer, seed=seed)
    report = pretrain(model, processor, steps=pretrain_steps, seed=seed)
    demo.save_base(model, processor, Path(model_dir), report, pad_token_id=tokenizer.pad_token_id)
    build_dataset(Path(data_dir))
    return report
