"""`python -m pipeline prepare-base`: build the embedded default (see pipeline.demo)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from pipeline import demo

    ap = argparse.ArgumentParser(prog="python -m pipeline prepare-base", description=demo.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--pretrain-steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    report = demo.prepare_base(args.model_dir, args.data_dir, pretrain_steps=args.pretrain_steps, seed=args.seed)
    print(f"embedded base: {args.model_dir} (raw copy-task exact match {report['copy_exact_match']:.2f} "
          f"after {report['steps']} pre-training steps, {report['seconds']} s); dataset: {args.data_dir}")
    return 0
