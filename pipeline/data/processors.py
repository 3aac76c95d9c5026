"""A vision-language model's processor as this machine can build it.

`build_processor(model)` is the model's `AutoProcessor`. In Transformers 5 the
processors of Qwen2-VL, Qwen3-VL, Qwen3.5, SmolVLM2, InternVL, GLM-4.1V and
Gemma 4 hold a video processor that needs torchvision; without it, the same
processor class is built from its tokenizer, image processor and saved settings,
with a stand-in for the video half that refuses any use but gives its saved
settings (`_image_only`: MiniCPM-V 4.6's processor reads its `slice_mode`). A
processor class that transformers hides without torchvision although it needs it
only for a helper (Pixtral's) is imported all the same (`processor_class`). A
processor that cannot be built even so (an image processor that exists only for
torchvision, as LFM2-VL's) is one `UserError` naming the model and what is
missing. `pipeline.data.vision` reads its image side.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pipeline.errors import UserError

log = logging.getLogger(__name__)


def build_processor(model, trust_remote_code: bool):
    """The model's `AutoProcessor`; where one of its parts cannot be built here (a video processor that needs
    torchvision), the same processor class with that part standing in (`_image_only`)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(str(model), trust_remote_code=trust_remote_code)
    except ImportError as err:  # a part's class needs a package not installed here
        missing = err
    except ValueError as err:
        if "torchvision" not in str(err):  # the auto video processor's way to say it needs torchvision
            raise UserError(f"cannot load the processor of {model}: {err}") from None
        missing = ImportError(str(err))
    except OSError as err:
        raise UserError(f"cannot load the processor of {model}: {err}") from None
    try:
        return _image_only(model, trust_remote_code, missing)
    except (ImportError, ValueError) as err:  # a part an image-only run needs: its image processor, the class itself
        raise UserError(f"cannot build the processor of {model}: {_first_line(err)}") from None


def _first_line(err: Exception) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _image_only(model, trust_remote_code: bool, missing: ImportError):
    """The model's processor class built from its tokenizer, its image processor and its saved settings, with
    an `_Absent` for each video part (an audio one, Gemma 4's, built as it is): the class's own `__init__`
    runs, so its `replace_image_token` reads what it always reads. Only the type check of the parts is
    relaxed, for the stand-ins (5.2x checks a video processor against a class it does not export without
    torchvision)."""
    from transformers import AutoFeatureExtractor, AutoTokenizer

    settings = _processor_settings(model)
    cls = processor_class(str(settings.pop("processor_class", None)))
    if cls is None or not hasattr(cls, "replace_image_token"):
        raise missing
    reason = _first_line(missing)
    parts = {"tokenizer": AutoTokenizer.from_pretrained(str(model), trust_remote_code=trust_remote_code),
             "image_processor": image_processor(model, trust_remote_code)}
    args = []
    for name in cls.get_attributes():
        if name == "feature_extractor":  # an audio half (Gemma 4's): built as it is, if it can be
            parts[name] = AutoFeatureExtractor.from_pretrained(str(model), trust_remote_code=trust_remote_code)
        elif name not in parts and "video" not in name:
            raise missing
        args.append(parts.get(name) or _Absent(name, reason, _part_settings(model, name)))

    class ImageOnly(cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            if isinstance(argument, _Absent):
                return _Absent
            return super().check_argument_for_proper_class(argument_name, argument)

        def to_dict(self):  # its settings, as saved: the stand-ins were never saved
            return {k: v for k, v in super().to_dict().items() if not isinstance(v, _Absent)}

        def __reduce__(self):  # a class made here pickles as the call that makes it
            return _image_only, (model, trust_remote_code, ImportError(reason))

    ImageOnly.__name__ = ImageOnly.__qualname__ = cls.__name__
    log.warning("%s: %s; its %s is built for images only", model, reason, cls.__name__)
    return ImageOnly.from_args_and_dict(args, settings)


def image_processor(model, trust_remote_code: bool):
    """The model's `AutoImageProcessor`, or, where that needs torchvision, the PIL class of the family.

    Transformers 5.17 without torchvision hides `AutoImageProcessor` itself (a placeholder that raises), and
    a saved `image_processor_type` may name the torchvision class (Qwen2-VL's `Qwen2VLImageProcessor`, whose
    PIL twin is `Qwen2VLImageProcessorPil`): then the family's PIL class, as the auto mapping names it for the
    model type, is built from the same saved settings."""
    import transformers

    try:
        return transformers.AutoImageProcessor.from_pretrained(str(model), trust_remote_code=trust_remote_code)
    except ImportError as err:
        missing = err
    cls = _pil_image_processor(model)
    if cls is None:
        raise missing
    log.info("%s: the image processor needs torchvision; built as its PIL twin %s", model, cls.__name__)
    return cls.from_pretrained(str(model))


def _pil_image_processor(model):
    """The PIL image processor class of the model's family (the auto mapping's `pil` entry for its model
    type, else the saved `image_processor_type` + `Pil`), or None where transformers has none here."""
    import importlib

    import transformers
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    from transformers.utils.import_utils import DummyObject

    root = Path(model)
    saved = json.loads((root / "preprocessor_config.json").read_text()) \
        if (root / "preprocessor_config.json").is_file() else {}
    config = json.loads((root / "config.json").read_text()) if (root / "config.json").is_file() else {}
    names = []
    entry = IMAGE_PROCESSOR_MAPPING_NAMES.get(config.get("model_type"))
    if isinstance(entry, dict) and entry.get("pil"):
        names.append(entry["pil"])
    if saved.get("image_processor_type"):
        names.append(str(saved["image_processor_type"]).removesuffix("Fast") + "Pil")
    for name in names:
        cls = getattr(transformers, name, None)
        if cls is not None and not isinstance(cls, DummyObject):
            return cls
    # 5.17 marks some PIL classes as needing torchvision at the top level (SmolVLM's, Ovis2's) although their
    # module imports without it: the family's PIL module itself
    model_type = str(config.get("model_type", ""))
    try:
        module = importlib.import_module(f"transformers.models.{model_type}.image_processing_pil_{model_type}")
    except ImportError:
        return None
    found = [getattr(module, name, None) for name in names]
    return next((cls for cls in found if isinstance(cls, type)), None)


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

    try:
        cls = getattr(transformers, name, None)
    except ImportError:  # 5.17: the lazy import itself fails (Gemma 4's module imports its torchvision half)
        where = _processor_module(name)
    else:
        if not isinstance(cls, DummyObject):
            return cls
        where = cls.__module__
    if where is None:
        return None
    package, module = where.rsplit(".", 1)
    stem = module.removeprefix("processing_")
    torchvision_half = f"{package}.image_processing_{stem}"
    try:
        twin = importlib.import_module(f"{package}.image_processing_pil_{stem}")
    except ImportError:
        return None
    before = sys.modules.get(torchvision_half)
    sys.modules[torchvision_half] = twin
    try:
        found = getattr(importlib.import_module(where), name, None)
    except ImportError:
        return None
    finally:
        if before is None:
            sys.modules.pop(torchvision_half, None)
        else:
            sys.modules[torchvision_half] = before
    return None if isinstance(found, DummyObject) else found


def _processor_module(name: str) -> str | None:
    """The module of processor class `name`, by the model type the auto mapping gives it, or None."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    types = [t for t, n in PROCESSOR_MAPPING_NAMES.items() if n == name]
    return f"transformers.models.{types[0]}.processing_{types[0]}" if types else None


class _Absent:
    """Stands in for a processor part that cannot be built here (a video processor without torchvision):
    it contributes no model inputs and refuses any use, saying why. Its saved `settings` can be read as
    attributes: a processor's `__init__` may copy some (MiniCPM-V 4.6's reads its video processor's
    `slice_mode`)."""

    model_input_names: tuple = ()

    def __init__(self, name: str, reason: str, settings: dict | None = None):
        self.name, self.reason, self.settings = name, reason, dict(settings or {})

    def __getattr__(self, key: str):
        settings = self.__dict__.get("settings", {})
        if key in settings:
            return settings[key]
        raise AttributeError(f"the processor's {self.__dict__.get('name')} cannot be built here "
                             f"({self.__dict__.get('reason')}) and its saved settings have no {key!r}")

    def __call__(self, *args, **kwargs):
        raise UserError(f"the processor's {self.name} cannot be used here: {self.reason}")


def _part_settings(model, name: str) -> dict:
    """The saved settings of the processor part `name` of a local dir: its own file
    (`video_preprocessor_config.json` for the video processor), else its section of processor_config.json."""
    from transformers.utils import VIDEO_PROCESSOR_NAME

    root = Path(model)
    own = root / VIDEO_PROCESSOR_NAME if name == "video_processor" else None
    if own is not None and own.is_file():
        return json.loads(own.read_text())
    if (root / "processor_config.json").is_file():
        section = json.loads((root / "processor_config.json").read_text()).get(name)
        return section if isinstance(section, dict) else {}
    return {}


def _processor_settings(model) -> dict:
    """processor_config.json of a local dir (its sub-processors' own sections left out), with the processor
    class from the tokenizer config as a fallback and the chat template of chat_template.jinja."""
    root = Path(model)
    settings: dict = {}
    for name in ("tokenizer_config.json", "processor_config.json"):
        if (root / name).is_file():
            data = json.loads((root / name).read_text())
            settings.update({k: v for k, v in data.items() if not isinstance(v, dict)
                             and (name == "processor_config.json" or k == "processor_class")})
    if (root / "chat_template.jinja").is_file():
        settings["chat_template"] = (root / "chat_template.jinja").read_text()
    return settings
