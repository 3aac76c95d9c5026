"""The run's tokenizer as every stage reads it: where it is, and what `CHAT_FILE` says of it.

`python -m pipeline prepare-tokenizer` (`pipeline.data.prepare`) writes
``results/<run>/tokenizer/``: the base model's tokenizer with the chat template the
run trains with and any turn markers it had to add as special tokens. `CHAT_FILE`
beside it records the template, the added tokens with their ids, the vocabulary
size and the end-of-turn marker. Validation, tokenization, training, evaluation
and export read the dir through this module, torch-free (the workflow's load-time
checks use it too).

A run's trainer config names the dir in `model.tokenizer`; a config without one
(a test, a benchmark) reads the base model dir's own tokenizer (`path`).
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.config import ModelConfig
from pipeline.errors import UserError

CHAT_FILE = "chat.json"
GENERATION_CONFIG = "generation_config.json"  # the model's, copied beside its tokenizer: its stop tokens


def eos_ids(generation_config: dict) -> list[int]:
    """A generation config's ``eos_token_id`` as a list: it holds one id, several, or none."""
    ids = generation_config.get("eos_token_id")
    return [ids] if isinstance(ids, int) else [i for i in ids or () if isinstance(i, int)]

FSDP_TOKENS_ERROR = ("{where} adds special tokens {tokens} (data.chat_template={template!r} on a vocabulary "
                     "without them), whose embedding rows must be trained; distributed.strategy=fsdp does not "
                     "support that yet: use distributed.strategy=ddp, or a chat template whose turn markers "
                     "the vocabulary has")


def path(model: ModelConfig) -> str:
    """The tokenizer dir a run renders and decodes with: the run's (`model.tokenizer`), else the base's."""
    return model.tokenizer or model.path


def read_chat(tokenizer_dir: str | Path) -> dict:
    """The run tokenizer's `CHAT_FILE`; {} for a tokenizer dir that has none (a model dir)."""
    file = Path(tokenizer_dir) / CHAT_FILE
    return json.loads(file.read_text()) if file.is_file() else {}


def added_token_ids(tokenizer_dir: str | Path) -> list[int]:
    """Ids of the special tokens the run added to the base vocabulary (their rows must be trained)."""
    return sorted(read_chat(tokenizer_dir).get("added_tokens", {}).values())


def vocab_rows(tokenizer_dir: Path | str | None) -> int | None:
    """Rows the embeddings need for the run's tokenizer when it added tokens; None when it added none."""
    if tokenizer_dir is None:
        return None
    chat = read_chat(tokenizer_dir)
    added = chat.get("added_tokens") or {}
    if not added:
        return None
    return max(int(chat.get("vocab_size") or 0), max(added.values()) + 1)


def added_tokens(model: ModelConfig) -> list[int]:
    """Ids of the special tokens the run's tokenizer (`model.tokenizer`) added; [] without one."""
    return added_token_ids(model.tokenizer) if model.tokenizer else []


def refuse_added_tokens_sharded(model: ModelConfig) -> None:
    """UserError when the run's tokenizer added tokens: a sharded (FSDP) model trains no token rows.
    The caller decides that the model is sharded (distributed.strategy=fsdp over several ranks)."""
    if added_tokens(model):
        chat = read_chat(model.tokenizer)
        raise UserError(FSDP_TOKENS_ERROR.format(where=f"the run's tokenizer {model.tokenizer}",
                                                 tokens=", ".join(chat.get("added_tokens", {})),
                                                 template=chat.get("template", "?").removeprefix("builtin:")))
