"""`python -m pipeline prepare-base`: build an embedded default (see pipeline.demo.text and pipeline.demo.vlm)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

KINDS = ("text", "vlm")  # pipeline.demo.text (a causal LM), pipeline.demo.vlm (a LLaVA-style vision-language model)


def main(argv: list[str]) -> int:
    from pipeline.demo import text as demo, vlm as demo_vlm

    ap = argparse.ArgumentParser(prog="python -m pipeline prepare-base", description=demo.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=KINDS, default="text", help="text: the demo LM; vlm: the demo LLaVA")
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--pretrain-steps", type=int, default=None, help="default: 200 (text), 300 (vlm)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    module = demo if args.kind == "text" else demo_vlm
    steps = {"pretrain_steps": args.pretrain_steps} if args.pretrain_steps is not None else {}
    report = module.prepare_base(args.model_dir, args.data_dir, seed=args.seed, **steps)
    skill = ("raw copy-task exact match {copy_exact_match:.2f}" if args.kind == "text"
             else "caption colour accuracy {caption_color_accuracy:.2f}").format(**report)
    print(f"embedded base: {args.model_dir} ({skill} after {report['steps']} pre-training steps, "
          f"{report['seconds']} s); dataset: {args.data_dir}")
    return 0
