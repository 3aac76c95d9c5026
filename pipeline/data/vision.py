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
  Tokenization caches the expanded tokens, so a training step never re-renders
  anything.
* pixels: `pixels(paths)` decodes a batch's images and runs the processor's image
  processor, returning what the model's forward takes (``pixel_values``, and
  ``image_grid_thw`` for Qwen2-VL); `text_inputs(input_ids)` adds what the model
  derives from the tokens (Qwen2-VL's ``mm_token_type_ids`` for its 3-D RoPE,
  Gemma 3's ``token_type_ids`` for its attention within an image).
  The expansion and the pixels come from the same image processor with the same
  settings, so the image tokens of the cache always match the features.

One case builds the processor from its parts: in Transformers 5 the Qwen2-VL
processor also holds a video processor that needs torchvision, which an
image-only run does not. Without torchvision, `load_image_text` takes the
tokenizer and image processor on their own and calls the processor class's own
image step (`_process_images`, `replace_image_token`) on an instance holding just
its image half (see `_image_half`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pipeline.data.formats import IMAGE_PLACEHOLDER
from pipeline.data.images import open_rgb
from pipeline.errors import DataError, UserError

log = logging.getLogger(__name__)

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

    `process(images)` is the processor's image step: the image processor's
    output, and per image the text that stands for it (its `replace_image_token`).
    Expansions are cached per image path (an image shared by many records is
    processed once).
    `image_token` is what the chat template writes for an image, the processor's
    `image_token`: the token the features replace (`image_token_id`, the config's)
    for most families, Gemma 3's `<start_of_image>`, which the expansion turns into
    `<start_of_image>`, its `<image_soft_token>`s and `<end_of_image>`.
    """

    tokenizer: object
    image_processor: object
    chat_template: str
    image_token: str
    image_token_id: int
    # the processor's `_process_images`: images -> (image-processor output, each image's text); it passes the
    # image processor what the processor adds (Pixtral's patch: the tower's x the merge), then calls
    # `replace_image_token` per image
    process: Callable[..., tuple[dict, list[str]]]
    pixel_names: tuple[str, ...]  # image-processor outputs the model takes
    # the model's input of modality ids (1 on image tokens), or None: MM_TOKEN_TYPE_IDS (Qwen2-VL, for its
    # 3-D RoPE) or TOKEN_TYPE_IDS (Gemma 3, whose attention is bidirectional within an image)
    token_types: str | None
    _expansions: dict[str, str] = field(default_factory=dict, repr=False)

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
            try:
                _, texts = self.process([open_rgb(path)], return_tensors="np")
            except (OSError, ValueError) as err:
                raise DataError(f"cannot process image {path}: {err}") from None
            self._expansions[path] = str(texts[0])
        return self._expansions[path]

    def expand(self, text: str, paths: list[str], *, complete: bool = True) -> str:
        """`text` with its k-th image token replaced by the expansion of `paths[k]`.

        `complete`: the text must hold one image token per path (a whole
        conversation); otherwise it may hold fewer (a prefix of one).
        """
        pieces = text.split(self.image_token)
        found = len(pieces) - 1
        if found > len(paths) or (complete and found != len(paths)):
            raise DataError(f"the chat template wrote {found} image token(s) {self.image_token!r} "
                            f"for {len(paths)} image(s)")
        out = [pieces[0]]
        for path, piece in zip(paths, pieces[1:]):
            out += [self.expansion(path), piece]
        return "".join(out)

    # --- batch time -------------------------------------------------------------------------

    def pixels(self, paths: list[str]) -> dict:
        """The model's image inputs for these images, in order (decoded here: run it in a loader worker)."""
        processed, _ = self.process([open_rgb(p) for p in paths], return_tensors="pt")
        return {k: v for k, v in processed.items() if k in self.pixel_names}

    def text_inputs(self, input_ids) -> dict:
        """Inputs the model derives from the tokens: the modality ids (1 on image tokens) of Qwen2-VL, Gemma 3."""
        if not self.token_types:
            return {}
        return {self.token_types: (input_ids == self.image_token_id).to(input_ids.dtype)}


def load_image_text(model: str | Path, trust_remote_code: bool = False) -> ImageText:
    """The `ImageText` of a vision-language model dir or hub id; `UserError` if it has no usable processor."""
    from transformers import AutoProcessor

    config = model_config(model, trust_remote_code)
    if not config_is_vision_language(config):
        raise UserError(f"{model} is not an image-text-to-text model (no vision part in its config)")
    try:
        processor = AutoProcessor.from_pretrained(str(model), trust_remote_code=trust_remote_code)
    except ImportError as err:
        if "torchvision" not in str(err).lower():
            raise
        return _from_parts(model, config, trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load the processor of {model}: {err}") from None
    if getattr(processor, "image_processor", None) is None or not hasattr(processor, "replace_image_token"):
        raise UserError(f"the processor of {model} ({type(processor).__name__}) has no image processor")
    tokenizer = processor.tokenizer
    template = processor.chat_template or tokenizer.chat_template
    names = set(processor.model_input_names)
    return _image_text(model, config, tokenizer, processor.image_processor, template, processor._process_images,
                       pixel_names=tuple(n for n in processor.image_processor.model_input_names if n in names),
                       token_types=_token_types(type(processor), names), written=getattr(processor, "image_token", None))


def _token_types(cls, names) -> str | None:
    """The name a processor class gives the modality ids it returns (`names`: its instance's input names,
    None where there is no instance), or None when it returns none."""
    if not getattr(cls, "return_mm_token_type_ids", False):
        return None
    return next((n for n in (MM_TOKEN_TYPE_IDS, TOKEN_TYPE_IDS) if n in (names or ())), MM_TOKEN_TYPE_IDS)


def _image_text(model, config, tokenizer, image_processor, template, process, *, pixel_names, token_types,
                written: str | None = None) -> ImageText:
    """`written`: the processor's image token, what its chat template writes for an image (default: the
    config's image token)."""
    if not template:
        raise UserError(f"the processor of {model} has no chat template")
    token_id = config.image_token_id
    token = tokenizer.convert_ids_to_tokens(token_id)
    if token_id is None or token is None:
        raise UserError(f"{model}: the config's image_token_id {token_id} is not a token of its tokenizer")
    return ImageText(tokenizer, image_processor, template, written or token, token_id, process, pixel_names,
                     token_types)


class _TokenizerAttributes:
    """Attributes a processor sets from its tokenizer in its constructor (Gemma 4's `boi_token`, `eoi_token`:
    the tokenizer's named special tokens), read from the tokenizer where nothing else has them. Pickled
    by the processor class's name (loader workers may be started fresh), rebuilt by `_half_of`."""

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "tokenizer":
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def __reduce__(self):
        return _half_of, (self._processor_class, dict(self.__dict__))


def _half_of(name: str, state: dict):
    """An instance of processor class `name` (`processor_class`) with `state` as its attributes, its
    constructor not run."""
    cls = processor_class(name)
    half = object.__new__(type(f"{name}ImageHalf", (_TokenizerAttributes, cls), {}))
    half.__dict__.update(state)
    return half


def _image_half(cls, image_processor, tokenizer, settings: dict):
    """An instance of processor class `cls` holding only its image half: the image processor, the tokenizer
    and the processor's saved settings (patch size, image token, ...), its constructor not run (it would
    build the video half). Its own `_process_images` and `replace_image_token` then run as they are."""
    return _half_of(cls.__name__, {**settings, "image_processor": image_processor, "tokenizer": tokenizer,
                                   "_processor_class": cls.__name__})


def _from_parts(model, config, trust_remote_code: bool) -> ImageText:
    """The processor's image half, when its video half cannot be built (no torchvision)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    settings = _processor_settings(model)
    name = str(settings.get("processor_class"))
    cls = processor_class(name)
    if cls is None or not hasattr(cls, "replace_image_token"):
        raise UserError(f"cannot load the processor of {model}: it needs torchvision (not installed), and its "
                        f"class {name!r} cannot be used without it")
    tokenizer = AutoTokenizer.from_pretrained(str(model), trust_remote_code=trust_remote_code)
    image_processor = AutoImageProcessor.from_pretrained(str(model), trust_remote_code=trust_remote_code)
    settings = {k: v for k, v in settings.items() if not isinstance(v, dict)}
    # what processors take for their image token: the saved one, else the tokenizer's named one, else the config's
    settings.setdefault("image_token", getattr(tokenizer, "image_token", None)
                        or tokenizer.convert_ids_to_tokens(config.image_token_id))
    half = _image_half(cls, image_processor, tokenizer, settings)
    log.warning("%s: torchvision is not installed, so its %s cannot be built; using its image half only",
                model, cls.__name__)
    return _image_text(model, config, tokenizer, image_processor, settings.get("chat_template") or tokenizer.chat_template,
                       half._process_images,
                       pixel_names=tuple(n for n in image_processor.model_input_names if n not in _unused(cls, half)),
                       token_types=_token_types(cls, None), written=half.image_token)


def _unused(cls, half) -> set[str]:
    """The image-processor outputs a processor class keeps from the model (its `unused_input_names`: Gemma 4's
    `num_soft_tokens_per_image`, which only its `replace_image_token` reads)."""
    names = getattr(cls, "unused_input_names", ())
    return set(names.fget(half) if isinstance(names, property) else names or ())


def processor_class(name: str):
    """Transformers' processor class `name`, or None where there is none.

    Without torchvision, transformers gives a placeholder for a processor whose
    module imports a helper from its torchvision image processor's module
    (Pixtral's, 5.17 to 5.24: `get_resize_output_image_size`, for counting tokens
    ahead). The family's PIL image processor module defines the same helpers, so
    the module is imported with that one standing in for the torchvision one
    (for the import only), which gives the real class; None where there is no
    PIL twin, or the module still needs what is not installed.
    """
    import importlib
    import sys

    import transformers
    from transformers.utils.import_utils import DummyObject

    cls = getattr(transformers, name, None)
    if not isinstance(cls, DummyObject):
        return cls
    package, module = cls.__module__.rsplit(".", 1)
    stem = module.removeprefix("processing_")
    torchvision_half = f"{package}.image_processing_{stem}"
    try:
        twin = importlib.import_module(f"{package}.image_processing_pil_{stem}")
    except ImportError:
        return None
    before = sys.modules.get(torchvision_half)
    sys.modules[torchvision_half] = twin
    try:
        found = getattr(importlib.import_module(cls.__module__), name, None)
    except ImportError:
        return None
    finally:
        if before is None:
            sys.modules.pop(torchvision_half, None)
        else:
            sys.modules[torchvision_half] = before
    return None if isinstance(found, DummyObject) else found


def _processor_settings(model) -> dict:
    """processor_config.json of a local dir, with the processor class from the tokenizer config as a fallback."""
    root = Path(model)
    settings: dict = {}
    for name in ("tokenizer_config.json", "processor_config.json"):
        if (root / name).is_file():
            data = json.loads((root / name).read_text())
            settings.update({k: v for k, v in data.items() if name == "processor_config.json" or k == "processor_class"})
    if (root / "chat_template.jinja").is_file():
        settings["chat_template"] = (root / "chat_template.jinja").read_text()
    return settings
