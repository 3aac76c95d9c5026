"""A vision-language model's processor, as the pipeline uses it: tokens at tokenize time, pixels at batch time.

A model is vision-language when its config has a vision part and Transformers
maps it to `AutoModelForImageTextToText` (LLaVA, Qwen2-VL, ...); `is_vision_language`
decides from the config alone. Everything else here is `ImageText`, built from the
model's own `AutoProcessor`:

* text: a record's messages become the content-part conversation the processor's
  chat template expects (an ``{"type": "image"}`` part per `IMAGE_PLACEHOLDER`),
  rendered to text; each image token the template writes is then expanded to
  the processor's own replacement for that image (`replace_image_token`: 576
  ``<image>`` for LLaVA-1.5, ``<|image_pad|>`` x (grid / merge^2) for Qwen2-VL).
  A render that does not open with the bos gets the one the processor's own
  tokenization would add (LLaVA's templates write none; their tokenizers add it).
  Tokenization caches the expanded tokens, so a training step never re-renders
  anything.
* pixels: `inputs(input_ids, images)` decodes a batch's images (run it in a loader
  worker) and runs the processor's image processor, returning what the model's
  forward takes (``pixel_values``, and ``image_grid_thw`` for Qwen2-VL), with what
  the model derives from the tokens (`text_inputs`: Qwen2-VL's ``mm_token_type_ids``
  for its 3-D RoPE, Gemma 3's ``token_type_ids`` for its attention within an image, and what a
  processor builds from the ids with its own ``create_<name>``: ERNIE 4.5 VL's ``moe_mm_token_type_ids``,
  which route image tokens to its vision experts).
  The expansion and the pixels come from the same image processor with the same
  settings (the processor's own image kwargs too: SmolVLM's row/col layout,
  InternVL's tiling, LLaVA-NeXT's padding of its anyres tiles), so the image
  tokens of the cache always match the features; a processor that writes each
  image's index in its record before it (MiniCPM-V 4.6: `<image_id>0</image_id>`,
  `image_ids`) has it written too. Where the model takes
  ``batch_num_images`` (LLaVA-OneVision: a record of several images has no
  tiles), a record's images are processed together for both (`per_record`).
* cross-attention (Llama 3.2 Vision, `cross_attention`): an image stays the one
  ``<|image|>`` the template writes; the pixels, ``aspect_ratio_ids`` and
  ``aspect_ratio_mask`` come nested per record (records x images x tiles, a
  record without images an empty slot, as the processor pads them), and
  ``cross_attention_mask`` (which text attends which image's tiles) is built
  from the batch's token ids and the tiles per image with the processor's own
  helpers. `inputs` gives all of a batch's image inputs, the same for training
  batches, prompts and verify-merge's probes.

One case builds the processor without `AutoProcessor`: a processor whose video
processor needs torchvision (Qwen2-VL, Qwen3-VL, SmolVLM2, InternVL, GLM-4.1V in
Transformers 5), which an image-only run does not. Without torchvision,
`load_image_text` builds the same processor class from its tokenizer, image
processor and saved settings, with a stand-in for the video processor that
refuses any use (`pipeline.data.processors`); a processor class that transformers
hides without torchvision although it needs it only for a helper (Pixtral's) is
imported all the same. A processor that cannot be built even
so (an image processor that exists only for torchvision, as LFM2-VL's) is one
`UserError` naming the model and what is missing; so is a prefix-LM (PaliGemma:
its processor makes the labels from the answer, its `suffix`, the prompt attended
both ways) and a processor that expands image tokens only in its own call
(Idefics2's: no `replace_image_token` of its own). Either way
the processor's own image step runs (`_process_images`: Pixtral's adds its patch
x merge size), so the image tokens and the pixels are what the processor gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pipeline.data.formats import IMAGE_PLACEHOLDER
from pipeline.data.images import open_rgb
from pipeline.data.processors import build_processor
from pipeline.errors import DataError, UserError

MM_TOKEN_TYPE_IDS = "mm_token_type_ids"  # model input derived from the tokens (1 = image token)
TOKEN_TYPE_IDS = "token_type_ids"  # the same, by Gemma 3's name


def model_config(model: str | Path, trust_remote_code: bool = False):
    """The model's `AutoConfig`, or None where there is none (a tokenizer-only dir)."""
    from transformers import AutoConfig

    if Path(model).is_dir() and not (Path(model) / "config.json").is_file():
        return None
    try:
        return AutoConfig.from_pretrained(str(model), trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None


def is_vision_language(model: str | Path, trust_remote_code: bool = False) -> bool:
    """True for an image-text-to-text model (a vision part in its config, an `AutoModelForImageTextToText` class)."""
    return config_is_vision_language(model_config(model, trust_remote_code))


def config_is_vision_language(config) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return (config is not None and getattr(config, "vision_config", None) is not None
            and config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


@dataclass
class ImageText:
    """The processor of a vision-language model, reduced to what training and evaluation need.

    `process(images, **kwargs)` is the processor's image step (`_process_images`):
    the image processor's output, and per image the text that stands for it
    (`replace_image_token`). Expansions are cached per image path (an image shared
    by many records is processed once).
    `image_token` is what the chat template writes for an image, the processor's
    `image_token`: the token the features replace (`image_token_id`, the config's)
    for most families, Gemma 3's `<start_of_image>`, which the expansion turns into
    `<start_of_image>`, its `<image_soft_token>`s and `<end_of_image>`; or the
    processor's `image_placeholder_token` where it has one (Qianfan-OCR's `<image>`).
    """

    tokenizer: object
    image_processor: object
    chat_template: str
    image_token: str
    image_token_id: int
    process: Callable[..., tuple[dict, list[str]]]
    pixel_names: tuple[str, ...]  # image-processor outputs the model takes (declared, or pixels its forward takes)
    # the model's input of modality ids (1 on image tokens), or None: MM_TOKEN_TYPE_IDS (Qwen2-VL, for its
    # 3-D RoPE) or TOKEN_TYPE_IDS (Gemma 3, whose attention is bidirectional within an image)
    token_types: str | None
    # what the processor passes its image processor and `replace_image_token` on every call (`_images_kwargs`)
    image_kwargs: dict = field(default_factory=dict)
    # the bos the processor's tokenization puts before a render that does not open with it ('' where none:
    # `_added_bos`); LLaVA's templates write none, their tokenizers add it
    bos: str = ""
    # the model reads its images through cross-attention layers under the processor's `cross_attention_mask`
    # (Llama 3.2 Vision): pixels nested per record, the mask built from the tokens and the tiles per image
    cross_attention: bool = False
    # more inputs the processor builds from the token ids alone, by name: its own `create_<name>(input_ids)`
    # (ERNIE 4.5 VL's `moe_mm_token_type_ids`, which route image tokens and their bounds to its vision experts)
    derived: dict[str, Callable] = field(default_factory=dict)
    # the processor's prefix to each image's text by the image's index in its record, or None (`_image_ids`:
    # MiniCPM-V 4.6 writes `<image_id>k</image_id>` before the k-th image), called as the processor calls it
    image_ids: Callable[..., list[str]] | None = None
    _expansions: dict[str, str] = field(default_factory=dict, repr=False)
    _records: dict[tuple[str, ...], list[str]] = field(default_factory=dict, repr=False)  # `per_record` layouts

    # --- text -----------------------------------------------------------------------------

    @staticmethod
    def conversation(messages: list[dict[str, str]]) -> list[dict]:
        """Messages as content parts: text, and an image part where each placeholder was."""
        out = []
        for message in messages:
            parts = []
            for k, text in enumerate(message["content"].split(IMAGE_PLACEHOLDER)):
                if k:
                    parts.append({"type": "image"})
                if text:
                    parts.append({"type": "text", "text": text})
            out.append({"role": message["role"], "content": parts})
        return out

    def expansion(self, path: str) -> str:
        """The processor's text for the image at `path` (its image tokens)."""
        if path not in self._expansions:
            self._expansions[path] = self._texts([open_rgb(path)], path)[0]
        return self._expansions[path]

    @property
    def per_record(self) -> bool:
        """Whether an image's tokens and features depend on how many images its record holds: the model takes
        `batch_num_images` (LLaVA-OneVision lays out each image of a record of several without its tiles)."""
        return "batch_num_images" in self.pixel_names

    def expansions(self, paths: list[str]) -> list[str]:
        """The processor's text for each image of one record, in order: each image's own `expansion`, or, where
        the layout is `per_record`, what the processor writes for the record's images together."""
        if not self.per_record or len(paths) < 2:
            return [self.expansion(p) for p in paths]
        key = tuple(paths)
        if key not in self._records:
            self._records[key] = self._texts([[open_rgb(p) for p in paths]], ", ".join(paths))
        return self._records[key]

    def _texts(self, images: list, named: str) -> list[str]:
        try:
            _, texts = self.process(images, **self.image_kwargs, return_tensors="np")
        except (OSError, ValueError) as err:
            raise DataError(f"cannot process image {named}: {err}") from None
        return [str(t) for t in texts]

    def expand(self, text: str, paths: list[str], *, complete: bool = True) -> str:
        """`text` with its k-th image token replaced by the expansion of `paths[k]`, and opened with the
        `bos` the processor's tokenization would add to it: the text the model reads, to be tokenized
        without special tokens.

        `complete`: the text must hold one image token per path (a whole
        conversation); otherwise it may hold fewer (a prefix of one).
        """
        if self.bos and not text.startswith(self.bos):
            text = self.bos + text
        pieces = text.split(self.image_token)
        found = len(pieces) - 1
        if found > len(paths) or (complete and found != len(paths)):
            raise DataError(f"the chat template wrote {found} image token(s) {self.image_token!r} "
                            f"for {len(paths)} image(s)")
        expanded = self.expansions(paths) if found else []
        if expanded and self.image_ids is not None:
            expanded = self.image_ids([text], expanded, self.image_token)
        out = [pieces[0]]
        for image, piece in zip(expanded, pieces[1:]):
            out += [image, piece]
        return "".join(out)

    # --- batch time -------------------------------------------------------------------------

    def _processed(self, paths: list[str], counts: list[int] | None) -> dict:
        """The image processor's whole output for these images, grouped by record where the layout needs it
        (a record without images an empty group where the images are nested per record)."""
        images = [open_rgb(p) for p in paths]
        if counts is not None and (self.per_record or self.cross_attention):
            taken = iter(images)
            images = [[next(taken) for _ in range(n)] for n in counts if n or self.cross_attention]
        processed, _ = self.process(images, **self.image_kwargs, return_tensors="pt")
        return processed

    def text_inputs(self, input_ids) -> dict:
        """Inputs the model derives from the tokens: the modality ids (1 on image tokens) of Qwen2-VL, Gemma 3,
        and the processor's `derived` ones."""
        import torch

        out = {name: torch.tensor(create(input_ids.tolist()), dtype=input_ids.dtype)
               for name, create in self.derived.items()}
        if self.token_types:
            out[self.token_types] = (input_ids == self.image_token_id).to(input_ids.dtype)
        return out

    def inputs(self, input_ids, images: list[list[str]]) -> dict:
        """Every image input of a batch: `input_ids` its (padded) rows, `images` each row's image paths in
        token order. The modality ids, the pixels, and for a `cross_attention` model the
        `cross_attention_mask` (rows x tokens x images x tiles) its processor builds from the same ids."""
        out = self.text_inputs(input_ids)
        paths = [p for own in images for p in own]
        if not paths:
            return out
        processed = self._processed(paths, [len(own) for own in images])
        out.update({k: v for k, v in processed.items() if k in self.pixel_names})
        if self.cross_attention:
            out["cross_attention_mask"] = self._cross_attention_mask(input_ids, processed)
        return out

    def _cross_attention_mask(self, input_ids, processed: dict):
        """Which token attends which tile of which image of its row, as `MllamaProcessor` builds it: each
        `<|image|>` opens a span up to the next one (images in a run share theirs), the last to the row's end,
        padding included (the processor pads before it builds the mask)."""
        import torch
        from transformers.models.mllama.processing_mllama import (convert_sparse_cross_attention_mask_to_dense,
                                                                  get_cross_attention_token_mask)

        spans = [get_cross_attention_token_mask(row, self.image_token_id) for row in input_ids.tolist()]
        # as many tiles as the pixels carry: the image processor's max_image_tiles, which the processor reads too
        dense = convert_sparse_cross_attention_mask_to_dense(spans, processed["num_tiles"],
                                                             max_num_tiles=processed["pixel_values"].shape[2],
                                                             length=input_ids.shape[1])
        return torch.from_numpy(dense)


def load_image_text(model: str | Path, trust_remote_code: bool = False) -> ImageText:
    """The `ImageText` of a vision-language model dir or hub id; `UserError` if it has no usable processor."""
    config = model_config(model, trust_remote_code)
    if not config_is_vision_language(config):
        raise UserError(f"{model} is not an image-text-to-text model (no vision part in its config)")
    processor = build_processor(model, trust_remote_code)
    if getattr(processor, "image_processor", None) is None or not hasattr(processor, "replace_image_token"):
        raise UserError(f"the processor of {model} ({type(processor).__name__}) has no image processor")
    if not _expands_each_image(type(processor)):
        raise UserError(f"{model}: its processor ({type(processor).__name__}) expands the image tokens inside its own "
                        "call, not per image (replace_image_token), which is how the pipeline writes them")
    if "labels" in processor.model_input_names:  # 5.17 and 5.2x alike (its `suffix` is a text kwarg in 5.17)
        raise UserError(f"{model}: {config.model_type} is a prefix-LM (its processor makes the labels itself from the "
                        "answer, its `suffix`, and marks the prompt with token_type_ids, which the model attends both "
                        "ways): the pipeline's chat records and causal attention do not train it as it was trained")
    tokenizer = processor.tokenizer
    template = processor.chat_template or tokenizer.chat_template
    if not template:
        raise UserError(f"the processor of {model} has no chat template")
    token_id = config.image_token_id
    token = tokenizer.convert_ids_to_tokens(token_id)
    if token_id is None or token is None:
        raise UserError(f"{model}: the config's image_token_id {token_id} is not a token of its tokenizer")
    names = set(processor.model_input_names)
    declared = tuple(n for n in processor.image_processor.model_input_names if n in names)
    return ImageText(tokenizer, processor.image_processor, template, _template_image_token(processor) or token,
                     token_id, processor._process_images,
                     declared + tuple(n for n in _forward_pixels(config) if n not in declared),
                     _token_types(processor, names), _images_kwargs(processor), _added_bos(processor),
                     cross_attention="cross_attention_mask" in names, derived=_derived(processor, names),
                     image_ids=_image_ids(processor))


def _forward_pixels(config) -> tuple[str, ...]:
    """The image pixel inputs (`pixel_values*`, not a video's) the model's forward takes, some of which its image
    processor may give without declaring them (DeepSeek-OCR 2's `pixel_values_local`, the crops of an image larger
    than a tile, beside the declared global view); () where the class is not known (remote code)."""
    import inspect

    from transformers import AutoModelForImageTextToText

    try:
        forward = AutoModelForImageTextToText._model_mapping[type(config)].forward
    except (KeyError, ValueError):
        return ()
    # a video's pixels (`pixel_values_videos`) come from the video processor, never from the image one
    return tuple(n for n in inspect.signature(forward).parameters if n.startswith("pixel_values") and "video" not in n)


def _template_image_token(processor) -> str | None:
    """What the processor's chat template writes for an image, which its call expands: its placeholder where it
    keeps one apart from the token the features replace (Qianfan-OCR's `image_placeholder_token`, `<image>`,
    becomes `<img>`, its `<IMG_CONTEXT>`s and `</img>`), else its `image_token`; None where it names neither."""
    return getattr(processor, "image_placeholder_token", None) or getattr(processor, "image_token", None)


def _expands_each_image(cls) -> bool:
    """Whether a processor class writes each image's tokens by its own `replace_image_token` (the base class's
    raises NotImplementedError: Idefics2's processor expands them in its `__call__`, over the whole text)."""
    from transformers.processing_utils import ProcessorMixin

    return getattr(cls, "replace_image_token", None) is not ProcessorMixin.replace_image_token


def _token_types(processor, names) -> str | None:
    """The name a processor gives the modality ids it returns (`names`: its input names), or None when it
    returns none. It returns them where its class says so (`return_mm_token_type_ids`, 5.2x) or its default
    text kwargs do (5.17: Gemma 3's, Qwen2-VL's). A processor that returns them only when asked, but names them
    among the model's inputs (Cosmos 3 Edge's, whose model needs them for its 3-D RoPE), is taken at its word."""
    asked = getattr(type(processor), "return_mm_token_type_ids", False) \
        or _call_kwargs(processor, "text_kwargs").get("return_mm_token_type_ids", False)
    if not asked and MM_TOKEN_TYPE_IDS not in names:
        return None
    return next((n for n in (MM_TOKEN_TYPE_IDS, TOKEN_TYPE_IDS) if n in names), MM_TOKEN_TYPE_IDS)


def _derived(processor, names) -> dict[str, Callable]:
    """The processor's own builders of inputs it declares (`names`) from the token ids alone: a method
    `create_<name>(input_ids)` its class defines (not the base class's `create_mm_token_type_ids`, which
    `_token_types` stands for), called with the ids as lists."""
    import inspect

    from transformers.processing_utils import ProcessorMixin

    out = {}
    for name in sorted(names):
        create = getattr(type(processor), f"create_{name}", None)
        if (create is None or create is getattr(ProcessorMixin, f"create_{name}", None)
                or name in (MM_TOKEN_TYPE_IDS, TOKEN_TYPE_IDS)):
            continue
        if len(inspect.signature(create).parameters) == 2:  # (self, input_ids): nothing but the ids
            out[name] = getattr(processor, f"create_{name}")
    return out


def _call_kwargs(processor, modality: str) -> dict:
    """What the processor passes its `modality` part ("images_kwargs", "text_kwargs") on every call: its
    class's defaults merged with its settings, by the processor's own merge (a private method, called the
    same way in 5.17 and 5.2x)."""
    return processor._merge_kwargs(processor.valid_processor_kwargs,
                                   tokenizer_init_kwargs=processor.tokenizer.init_kwargs)[modality]


def _images_kwargs(processor) -> dict:
    """What the processor passes its image processor on every call (SmolVLM's `return_row_col_info`,
    InternVL's `crop_to_patches`, LLaVA-NeXT's `do_pad`), without the tensor type, which each call chooses."""
    return {k: v for k, v in _call_kwargs(processor, "images_kwargs").items() if k != "return_tensors"}


def _image_ids(processor):
    """The processor's own step that prefixes each image's text with the image's index in its record, where
    the processor has one (`_prepend_local_ids`, which its `__call__` runs after `_process_images`) and its
    settings turn it on (`use_image_id`: MiniCPM-V 4.6's default); else None."""
    prepend = getattr(processor, "_prepend_local_ids", None)
    if prepend is None:
        return None
    merged = processor._merge_kwargs(processor.valid_processor_kwargs,
                                     tokenizer_init_kwargs=processor.tokenizer.init_kwargs)
    use = merged["images_kwargs"].get("use_image_id", merged.get("use_image_id"))
    use = getattr(processor, "default_use_image_id", False) if use is None else use
    return prepend if use else None


def _added_bos(processor) -> str:
    """The bos that tokenizing a rendered conversation as the processor does puts before it, or ''.

    A processor tokenizes a render with the tokenizer's special tokens (its text default `add_special_tokens`,
    True unless it says otherwise), leaving them out only where the render opens with the bos
    (`apply_chat_template(tokenize=True)`, 5.17 and 5.2x alike); a tokenizer whose post-processor adds a bos
    (Llama's, Mistral's) then opens every sequence with it, so LLaVA's models, whose templates write none,
    always read one."""
    tokenizer = processor.tokenizer
    if not _call_kwargs(processor, "text_kwargs").get("add_special_tokens", True) or tokenizer.bos_token is None:
        return ""
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    added = with_special[:1] == [tokenizer.bos_token_id] != tokenizer("a", add_special_tokens=False)["input_ids"][:1]
    return tokenizer.bos_token if added else ""
