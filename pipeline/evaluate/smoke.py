"""Smoke test of the exported model: does the merged model answer held-out prompts?

    python -m pipeline smoke-test --model results/<run>/export/merged \
        --test held_out.jsonl --out results/<run>/export/smoke_test.json [--min-exact-match 0.5]

Loads the merged dir with stock `AutoModelForCausalLM.from_pretrained`, or for a
vision-language model `AutoModelForImageTextToText` and `AutoProcessor` (in this
fresh process, as a user would), decodes greedily and reports exact match. With
`--min-exact-match` the command fails below that rate.

Without a test set (``data.test: null``: no ``--test``) it still proves that the
model loads and answers a prompt, and writes ``exact_match: null``, ``n: 0`` and
``skipped: [skipped.NO_TEST]``, not a score of that one unreferenced answer;
`--min-exact-match` then has nothing to apply to and says so.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pipeline.data.vision import config_is_vision_language, load_image_text
from pipeline.errors import UserError
from pipeline.evaluate.metrics import HeldOut, add_held_out_args, exact_match, held_out_examples
from pipeline.evaluate.skipped import NO_TEST, SKIPPED_KEY
from pipeline.model.loading import auto_class
from pipeline.model.prompts import Prompts


def main(argv: list[str]) -> int:
    from transformers import AutoConfig, AutoTokenizer

    ap = argparse.ArgumentParser(prog="python -m pipeline smoke-test", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    add_held_out_args(ap)
    ap.add_argument("--min-exact-match", type=float, default=None)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = AutoConfig.from_pretrained(args.model)
    model = auto_class(config).from_pretrained(args.model).to(device)
    images = load_image_text(args.model) if config_is_vision_language(config) else None  # via AutoProcessor
    prompts = Prompts(images.tokenizer if images else AutoTokenizer.from_pretrained(args.model), images)
    examples = held_out_examples(args.test, args.max_test, args)
    if examples:
        result = exact_match(model, prompts, examples, device=device, max_new_tokens=args.max_new_tokens)
    else:  # no held-out set: at least prove the model loads and generates; nothing is scored
        result = skipped_result(exact_match(model, prompts, [HeldOut([{"role": "user", "content": "Hello"}], "", [])],
                                            device=device, max_new_tokens=args.max_new_tokens))
    result["model"] = str(args.model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    from pipeline.tracker import Tracker

    if result["exact_match"] is not None:
        tracker = Tracker(args.out.parent.parent, job="smoke test")  # the run's tracker, if any
        tracker.log_final({"final/exact_match": result["exact_match"]})
        tracker.close()
    print(report_line(result, args.min_exact_match))
    for s in result["samples"]:
        print(f"  {s['prompt']!r} -> {s['answer']!r}" + (f" (expected {s['reference']!r})" if examples else ""))
    if args.min_exact_match is not None and examples and result["exact_match"] < args.min_exact_match:
        raise UserError(f"smoke test: exact match {result['exact_match']:.3f} < --min-exact-match {args.min_exact_match}")
    return 0


def skipped_result(generated: dict) -> dict:
    """The smoke result of a run without a test set: the answer to a probe prompt, no score."""
    return {**generated, "exact_match": None, "n": 0, SKIPPED_KEY: [NO_TEST]}


def report_line(result: dict, min_exact_match: float | None = None) -> str:
    """The smoke test's summary line: the exact match, or that it was skipped (and the threshold not applied)."""
    if result["exact_match"] is None:
        unapplied = f"; --min-exact-match {min_exact_match} not applied" if min_exact_match is not None else ""
        return f"smoke test: {NO_TEST} (the merged model loaded and answered a probe prompt){unapplied}"
    return f"merged model exact match on {result['n']} held-out prompts: {result['exact_match']:.3f}"
