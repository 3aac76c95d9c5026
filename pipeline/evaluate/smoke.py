"""Smoke test of the exported model: does the merged model answer held-out prompts?

    python -m pipeline smoke-test --model results/<run>/export/merged \
        --test held_out.jsonl --out results/<run>/export/smoke_test.json [--min-exact-match 0.5]

Loads the merged dir with stock `AutoModelForCausalLM.from_pretrained`, or for a
vision-language model `AutoModelForImageTextToText` and `AutoProcessor` (in this
fresh process, as a user would), decodes greedily and reports exact match. With
`--min-exact-match` the command fails below that rate.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pipeline.data.vision import config_is_vision_language, load_image_text
from pipeline.errors import UserError
from pipeline.evaluate.metrics import HeldOut, add_held_out_args, exact_match, held_out_examples
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
    examples = held_out_examples(args.test, args.max_test, args.columns, args.roles)
    if not examples:
        # No held-out set: at least prove the model loads and generates.
        examples = [HeldOut([{"role": "user", "content": "Hello"}], "", [])]
    result = exact_match(model, prompts, examples, device=device, max_new_tokens=args.max_new_tokens)
    result["model"] = str(args.model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    from pipeline.tracker import Tracker

    tracker = Tracker(args.out.parent.parent, job="smoke test")  # the run's tracker, if any
    tracker.log_final({"final/exact_match": result["exact_match"]})
    tracker.close()
    print(f"merged model exact match on {result['n']} held-out prompts: {result['exact_match']:.3f}")
    for s in result["samples"]:
        print(f"  {s['prompt']!r} -> {s['answer']!r} (expected {s['reference']!r})")
    if args.min_exact_match is not None and result["exact_match"] < args.min_exact_match:
        raise UserError(f"smoke test: exact match {result['exact_match']:.3f} < --min-exact-match {args.min_exact_match}")
    return 0
