"""`python -m pipeline chat`: ask an exported model something, with the chat template it was trained with.

    python -m pipeline chat results/<run>/export/merged --prompt "repeat: abc"
    echo "repeat: abc" | python -m pipeline chat results/<run>/export/adapter_ema
    python -m pipeline chat DIR --each-line < prompts.txt      # one answer per input line
        [--system TEXT] [--max-new-tokens N] [--sample --temperature T --top-p P --seed S]
        [--base DIR] [--device cpu|cuda]

Works on every export dir. A model dir (merged/, or a full fine-tune) loads with
stock `AutoModelForCausalLM.from_pretrained`; an adapter dir (adapter_config.json)
loads its base (`base_model_name_or_path`, or `--base`), grows the base's
embeddings to the adapter's tokenizer when the run added tokens, and applies the
adapter with `PeftModel.from_pretrained`. Either way the prompt is rendered with
the export dir's own tokenizer and chat template (`pipeline.model.prompts.Prompts`,
the same code as evaluation and the smoke test), and generation stops at the
template's end-of-turn marker. Decoding is greedy unless `--sample`, so the
answers are the smoke test's. The prompt comes from `--prompt` or else stdin (the
whole of it, or each line with `--each-line`); answers go to stdout.
Vision-language exports are refused (use transformers' AutoProcessor directly).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from pipeline.errors import UserError


def load(export_dir: Path | str, *, base: Path | str | None = None, device: str | torch.device = "cpu"):
    """(model in eval mode on `device`, `Prompts`) of an export dir: a model dir or a PEFT adapter dir
    (`pipeline.model.exported.load`: an adapter on its grown base)."""
    from pipeline.model import exported
    from pipeline.model.prompts import Prompts

    model, tokenizer = exported.load(export_dir, base=base, device=device)
    return model, Prompts(tokenizer)


@torch.no_grad()
def answer(model, prompts, questions: list[str], *, system: str | None = None, max_new_tokens: int = 256,
           sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None,
           batch_size: int = 32) -> list[str]:
    """Answers to `questions` (each a user turn, after an optional system turn), decoded like the smoke test."""
    device = next(model.parameters()).device
    if seed is not None:
        torch.manual_seed(seed)
    options = dict(do_sample=True, temperature=temperature, top_p=top_p) if sample else dict(do_sample=False)
    answers = []
    for start in range(0, len(questions), batch_size):
        chunk = questions[start:start + batch_size]
        conversations = [([{"role": "system", "content": system}] if system else [])
                         + [{"role": "user", "content": q}] for q in chunk]
        enc = {k: v.to(device) for k, v in prompts.encode(conversations, [[] for _ in chunk]).items()}
        out = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=prompts.pad_token_id,
                             eos_token_id=prompts.eos_token_id, **options)
        answers += [prompts.decode(row) for row in out[:, enc["input_ids"].shape[1]:]]
    return answers


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m pipeline chat", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("export_dir", type=Path, help="an export dir: merged/, adapter_final/, adapter_ema/, adapter_best*/")
    ap.add_argument("--prompt", help="the user message (default: read stdin)")
    ap.add_argument("--each-line", action="store_true", help="stdin: one prompt per non-empty line, one answer per line")
    ap.add_argument("--system", help="a system message before the prompt")
    ap.add_argument("--base", help="an adapter's base model dir (default: the adapter's base_model_name_or_path)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    ap.add_argument("--temperature", type=float, default=1.0, help="with --sample")
    ap.add_argument("--top-p", type=float, default=1.0, help="with --sample")
    ap.add_argument("--seed", type=int, default=None, help="with --sample: reproducible samples")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when there is one)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.sample and (args.temperature != 1.0 or args.top_p != 1.0 or args.seed is not None):
        raise UserError("--temperature, --top-p and --seed apply to --sample (decoding is greedy without it)")
    if args.prompt is not None:
        questions = [args.prompt]
    else:
        text = sys.stdin.read()
        questions = [line.strip() for line in text.splitlines() if line.strip()] if args.each_line else [text.strip()]
    if not questions or not all(questions):
        raise UserError("no prompt: pass --prompt TEXT or write it to stdin")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, prompts = load(args.export_dir, base=args.base, device=device)
    answers = answer(model, prompts, questions, system=args.system, max_new_tokens=args.max_new_tokens,
                     sample=args.sample, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    for text in answers:
        print(text.replace("\n", "\\n") if args.each_line else text)
    return 0
