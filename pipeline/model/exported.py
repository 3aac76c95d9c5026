"""A model to run from an exported dir, or from the base model as the run saw it before training.

Every exported dir carries the run's tokenizer (`pipeline.export.tokenizer`). A model dir
(`merged/`, a full fine-tune) loads with stock `from_pretrained`. A PEFT adapter dir loads its
base (`base_model_name_or_path`, or the base given), grows the base's embeddings (and untied
head) to the run's vocabulary when the run added tokens (the adapter holds those rows, as peft
trainable tokens, and replaces them), then applies the adapter with `PeftModel.from_pretrained`:
so base + adapter computes what the merged dir computes. The base alone with the run's
tokenizer (`tokenizer=`) is grown the same way, with the rows every stage starts from
(`pipeline.model.vocabulary.grow_rows`: the mean row), so prompts rendered with the run's chat
template (its added markers included) run on it. Used by `chat` and the benchmark jobs.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.compat import peft_wrapping
from pipeline.data.run_tokenizer import vocab_rows
from pipeline.errors import UserError

ADAPTER_CONFIG = "adapter_config.json"


def is_adapter(path: Path | str) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(adapter_dir: Path | str, base: Path | str | None = None) -> Path:
    """The base model dir of an adapter: `base` when given, else its `base_model_name_or_path`; a hub
    model's pin file (`model.json`) stands for its cached snapshot."""
    adapter_dir = Path(adapter_dir)
    base = base or json.loads((adapter_dir / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise UserError(f"{adapter_dir / ADAPTER_CONFIG} names no base model: pass its base")
    return model_dir(base)


def model_dir(path: Path | str) -> Path:
    """A model dir, or a hub model's pin file (results/<run>/model.json) resolved to its snapshot."""
    from pipeline.storage.hub import model_dir as local_dir

    return Path(path) if Path(path).is_dir() else local_dir(path)


def load(source: Path | str, *, base: Path | str | None = None, tokenizer: Path | str | None = None,
         device="cpu", dtype=None):
    """(causal LM in eval mode on `device`, its tokenizer) of `source`: a model dir or a PEFT adapter
    dir (on `base`, or the one it names). `tokenizer`: the tokenizer dir to use (default `source`'s
    own); the model's vocabulary grows to it when it added tokens. `dtype`: as `from_pretrained` takes
    it (None: the library's default). Imports torch and transformers here: the module's path helpers
    (`is_adapter`, `adapter_base`, `model_dir`) stay light for a job that only hashes files."""
    from transformers import AutoConfig, AutoTokenizer

    from pipeline.data.vision import config_is_vision_language
    from pipeline.model.base import auto_class
    from pipeline.model.vocabulary import grow_rows

    source = Path(source)
    if not source.is_dir():
        raise UserError(f"{source} is not a directory")
    adapter = is_adapter(source)
    if not adapter and not (source / "config.json").is_file():
        raise UserError(f"{source} is neither a model dir (config.json) nor a PEFT adapter dir ({ADAPTER_CONFIG})")
    weights = adapter_base(source, base) if adapter else source
    tokenizer_dir = Path(tokenizer) if tokenizer is not None else source
    if not (tokenizer_dir / "tokenizer_config.json").is_file():
        raise UserError(f"{tokenizer_dir} carries no tokenizer (tokenizer_config.json)")
    try:
        config = AutoConfig.from_pretrained(weights)
    except OSError as err:
        raise UserError(f"cannot load the base model {weights} of {source}: {err}; give its local dir") from err
    if config_is_vision_language(config):
        raise UserError(f"{source} is a vision-language model: load it with AutoModelForImageTextToText and "
                        "AutoProcessor (this loads text models)")
    kwargs = {"dtype": dtype} if dtype is not None else {}
    model = auto_class(config).from_pretrained(weights, **kwargs)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    # The run added tokens: rows for them (an adapter replaces them with its own trained rows).
    grow_rows(model, vocab_rows(tokenizer_dir) or len(tok))
    if adapter:
        from peft import PeftModel

        with peft_wrapping():
            model = PeftModel.from_pretrained(model, source)
    return model.to(device).eval(), tok
