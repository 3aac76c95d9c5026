"""The run's tokenizer: the base model's tokenizer with the chat template the run trains with.

`python -m pipeline prepare-tokenizer` writes ``results/<run>/tokenizer/``, which
validation, tokenization, training, evaluation and export all read, so every
stage renders prompts exactly as the training data was rendered, and the
exported dirs carry the same template (stock ``apply_chat_template`` on an export
gives the training render).

For a built-in template (`pipeline.data.chat.BUILTIN_TEMPLATES`), each turn
marker that the vocabulary cannot write as one token is added as a special
token; `CHAT_FILE` (``chat.json``, `pipeline.data.run_tokenizer`: how every stage reads it) records them with their ids, so training
can grow the embeddings and train those rows, and export can merge them.
Markers the vocabulary has (a Llama 3 base has ``<|eot_id|>``) are used as they are.

A vision-language model keeps its processor's own template: its processor
files are copied as they are (a different template is not supported yet).

`data.chat_template_kwargs` (`pipeline.data.template_vars`) become the defaults of
the run's template, in whichever file holds it; ``chat.json`` records them.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from pipeline.data.chat import BUILTIN_TEMPLATES, SETTING, TOKENIZER_OWN, resolve_template
from pipeline.data.run_tokenizer import CHAT_FILE, GENERATION_CONFIG
from pipeline.data.template_vars import with_defaults
from pipeline.data.vision import is_vision_language
from pipeline.errors import UserError
from pipeline.storage import hub

# Files of a model dir that are not part of its tokenizer / processor.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


def _needs_adding(tokenizer, token: str) -> bool:
    ids = tokenizer(token, add_special_tokens=False)["input_ids"]
    return len(ids) != 1 or tokenizer.convert_ids_to_tokens(ids[0]) != token


def _set_processor_defaults(out_dir: Path, kwargs: dict, model_dir: Path) -> None:
    """`kwargs` as the defaults of every chat template the copied processor files hold."""
    if not kwargs:
        return
    where = f"the chat template of {model_dir}"
    found = False
    if (out_dir / "chat_template.jinja").is_file():
        path = out_dir / "chat_template.jinja"
        path.write_text(with_defaults(path.read_text(encoding="utf-8"), kwargs, where=where), encoding="utf-8")
        found = True
    for name in ("chat_template.json", "processor_config.json", "tokenizer_config.json"):
        path = out_dir / name
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        value = data.get("chat_template")
        if isinstance(value, str):
            data["chat_template"] = with_defaults(value, kwargs, where=where)
        elif isinstance(value, list):  # named templates: [{"name": ..., "template": ...}]
            data["chat_template"] = [{**t, "template": with_defaults(t["template"], kwargs, where=where)}
                                     for t in value]
        else:
            continue
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        found = True
    if not found:
        raise UserError(f"data.chat_template_kwargs: the processor files of {model_dir} hold no chat template")


def prepare(model_dir: str | Path, out_dir: str | Path, chat_template: str | None,
            template_kwargs: dict | None = None) -> dict:
    """Write the run's tokenizer dir; returns what `CHAT_FILE` holds. `template_kwargs`:
    `data.chat_template_kwargs`, the defaults of the template's own variables."""
    template_kwargs = template_kwargs or {}
    from transformers import AutoTokenizer
    from tokenizers import AddedToken

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    if is_vision_language(model_dir):
        if chat_template not in TOKENIZER_OWN:
            raise UserError(f"{SETTING}={chat_template!r}: a vision-language model trains with its processor's "
                            "own chat template; leave the setting null")
        out_dir.mkdir(parents=True)
        for path in model_dir.iterdir():
            if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES) and not path.name.startswith("model."):
                shutil.copy2(path, out_dir / path.name)
        _set_processor_defaults(out_dir, template_kwargs, model_dir)
        info = {"model": str(model_dir), "template": "processor", "added_tokens": {}, "vision_language": True,
                "template_kwargs": template_kwargs}
        (out_dir / CHAT_FILE).write_text(json.dumps(info, indent=2) + "\n")
        return info
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as err:  # transformers raises many types for a bad dir
        raise UserError(f"cannot load a tokenizer from {model_dir}: {err}") from None
    base_size = len(tokenizer)
    template, source = resolve_template(chat_template, tokenizer, where=f"the tokenizer of {model_dir}")
    added: dict[str, int] = {}
    end_of_turn = None
    if source.startswith("builtin:"):
        spec = BUILTIN_TEMPLATES[source.removeprefix("builtin:")]
        new = [t for t in spec.special_tokens if _needs_adding(tokenizer, t)]
        if new:
            tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in new], special_tokens=True)
            added = {t: tokenizer.convert_tokens_to_ids(t) for t in new}
        end_of_turn = spec.end_of_turn or tokenizer.eos_token
        if end_of_turn is None:
            raise UserError(f"{SETTING}={chat_template!r} closes assistant turns with the eos token, and the "
                            f"tokenizer of {model_dir} has none")
    tokenizer.chat_template = with_defaults(template, template_kwargs, where=f"the chat template ({source})")
    if tokenizer.pad_token is None:
        # Batches need a pad id; the eos never appears inside a supervised span's middle.
        tokenizer.pad_token = tokenizer.eos_token
    out_dir.mkdir(parents=True)
    tokenizer.save_pretrained(str(out_dir))
    # The model's stop tokens: the labels end a turn at one (`pipeline.data.turns.model_stops`)
    if (model_dir / GENERATION_CONFIG).is_file():
        shutil.copy2(model_dir / GENERATION_CONFIG, out_dir / GENERATION_CONFIG)
    info = {
        "model": str(model_dir),
        "template": source,
        "base_vocab_size": base_size,
        "vocab_size": len(tokenizer),
        "added_tokens": added,
        "end_of_turn": end_of_turn,
        "end_of_turn_id": tokenizer.convert_tokens_to_ids(end_of_turn) if end_of_turn else None,
        "template_kwargs": template_kwargs,
    }
    (out_dir / CHAT_FILE).write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n")
    return info


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline prepare-tokenizer", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, type=hub.model_dir,
                   help="the base model's dir, or a hub model's model.json (its pinned snapshot in the HF cache)")
    p.add_argument("--chat-template", default=None,
                   help=f"{SETTING}: empty or 'tokenizer' = the tokenizer's own; a built-in name "
                        f"({', '.join(BUILTIN_TEMPLATES)}); or a path to a .jinja file")
    p.add_argument("--template-kwargs", default="{}", type=_json_mapping,
                   help="data.chat_template_kwargs as JSON: the template's own variables, e.g. "
                        "'{\"enable_thinking\": false}'")
    p.add_argument("--out", required=True, type=Path)
    return p


def _json_mapping(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    info = prepare(args.model, args.out, args.chat_template or None, args.template_kwargs)
    added = ", ".join(f"{t} ({i})" for t, i in info["added_tokens"].items()) or "none"
    defaults = ", ".join(f"{k}={v!r}" for k, v in info["template_kwargs"].items())
    print(f"tokenizer -> {args.out}: template {info['template']}{f' (defaults: {defaults})' if defaults else ''}, "
          f"special tokens added: {added}")
    return 0
