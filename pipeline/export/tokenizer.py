"""The run's tokenizer in every exported dir, so inference renders prompts as training did.

Training renders conversations with the run's tokenizer dir (``results/<run>/tokenizer``,
written by `pipeline.data.prepare`, read through `pipeline.data.run_tokenizer`): its chat
template, and the special tokens it added. An exported dir that carried the base's
tokenizer files instead would render another prompt (or none: a base model has no
template) and split the added turn markers into characters. `carry_tokenizer` therefore replaces the base's
tokenizer files in an export with the run's, and makes generation stop at the
end-of-turn marker the template closes assistant turns with
(``generation_config.json`` ``eos_token_id`` includes it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipeline.data.run_tokenizer import CHAT_FILE, GENERATION_CONFIG, eos_ids, read_chat, vocab_rows
from pipeline.errors import UserError
from pipeline.storage.hf_dir import WEIGHT_FILE

# Files that make up a tokenizer (or a processor's text side) in some format. An export drops the
# base's before copying the run's: a stale one (added_tokens.json, a slow tokenizer's vocab, an old
# chat_template.jinja) could shadow or contradict what the run trained with.
TOKENIZER_FILES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "merges.txt", "vocab.txt",
    "chat_template.jinja", "chat_template.json",
})
# Files in a tokenizer source that are not the tokenizer: the model's (a vision-language run's
# tokenizer dir is its processor dir, copied whole), and an exported adapter's own (merge takes
# the tokenizer from the adapter dir by default). The export keeps its own.
_NOT_TOKENIZER = frozenset({"config.json", GENERATION_CONFIG, "adapter_config.json", "best.json", "README.md"})


def is_tokenizer_dir(path: Path | str) -> bool:
    return (Path(path) / "tokenizer_config.json").is_file()


def carry_tokenizer(dst: Path | str, tokenizer_dir: Path | str, base: Path | str | None = None) -> None:
    """Put the run's tokenizer files in `dst` (in place of any there) and stop generation at its
    end-of-turn marker. `base`: the base model dir, whose generation config the export starts from
    when `dst` has none."""
    dst, tokenizer_dir = Path(dst), Path(tokenizer_dir)
    if not is_tokenizer_dir(tokenizer_dir):
        raise UserError(f"--tokenizer {tokenizer_dir} is not a tokenizer dir (no tokenizer_config.json)")
    for name in TOKENIZER_FILES:
        (dst / name).unlink(missing_ok=True)
    for path in sorted(tokenizer_dir.iterdir()):
        if (path.is_file() and not path.name.startswith(".") and path.name not in _NOT_TOKENIZER
                and not WEIGHT_FILE.fullmatch(path.name)):
            shutil.copy2(path, dst / path.name)
    if base is None and (dst / "adapter_config.json").is_file():  # an adapter names its base
        base = json.loads((dst / "adapter_config.json").read_text()).get("base_model_name_or_path")
    stop_at_end_of_turn(dst, read_chat(tokenizer_dir).get("end_of_turn_id"), base)


def stop_at_end_of_turn(dst: Path, end_of_turn_id: int | None, base: Path | str | None = None) -> None:
    """Add `end_of_turn_id` to `dst`'s generation config's eos ids (written from `base`'s if absent)."""
    if end_of_turn_id is None:
        return
    path = dst / GENERATION_CONFIG
    source = path if path.is_file() else Path(base) / GENERATION_CONFIG if base else None
    config = json.loads(source.read_text()) if source is not None and source.is_file() else {}
    eos = eos_ids(config)
    if end_of_turn_id in eos:
        if source == path:
            return
    else:
        eos.append(int(end_of_turn_id))
    config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


__all__ = ["CHAT_FILE", "TOKENIZER_FILES", "carry_tokenizer", "is_tokenizer_dir", "stop_at_end_of_turn", "vocab_rows"]
