"""`python -m pipeline tokenize`: tokenize a training file (and / or the validation file) into token caches.

One job tokenizes a file (`tokenize.tokenize_file`); a training file split into
shards is merged from its shards' parts (``--parts``: `parts.merge_parts`, the
shard jobs are ``python -m pipeline tokenize-shard``). Writes ``--out-stats``
(`pipeline.data.tokenize`'s module docstring lists its keys) and, with
``--shards-out``, each shard's records and time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pipeline.data.chat import REASONING_POLICIES
from pipeline.data.formats import DUPLICATE_POLICIES
from pipeline.data.parts import merge_parts, read_drop
from pipeline.data.shapes import add_arguments as add_field_arguments, fields_of
from pipeline.data.tokenize import (TOO_LONG_POLICIES, chat_counts_text, load_chat, tokenize_file,
                                    tokenizer_fingerprint)
from pipeline.errors import UserError
from pipeline.storage import publish


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline tokenize", description=__doc__.splitlines()[0].split(": ", 1)[1])
    # --train optional: a run of several training datasets (pipeline/data/mix.py) tokenizes each in a job of
    # its own, and its validation set alone.
    p.add_argument("--train", type=Path, help="needs --out-train; without it only --val is tokenized")
    p.add_argument("--val", type=Path, help="optional; without it no val cache is written")
    p.add_argument("--tokenizer", required=True, type=Path)  # the run's tokenizer dir (prepare-tokenizer)
    p.add_argument("--max-length", required=True, type=int)
    p.add_argument("--too-long", required=True, choices=TOO_LONG_POLICIES)
    # --duplicates / --reasoning: required, their defaults are the workflow schema's data.* (the rules pass them)
    p.add_argument("--duplicates", required=True, choices=DUPLICATE_POLICIES,
                   help="drop: cache each exact-duplicate conversation once; error / warn: keep every record "
                        "(validation enforces error)")
    p.add_argument("--reasoning", required=True, choices=REASONING_POLICIES,
                   help="assistant reasoning (<think>...</think>, reasoning_content): auto / keep train it where "
                        "the template renders it, drop removes it")
    add_field_arguments(p)
    p.add_argument("--drop", type=Path, help="validate --out-drop: the train copies duplicates=drop leaves out")
    p.add_argument("--parts", nargs="+", type=Path,
                   help="the train file's shard parts (tokenize-shard --out): merged into --out-train in file order")
    p.add_argument("--shards-out", type=Path, help="each train shard's records and time (JSON; one job: its own)")
    p.add_argument("--out-train", type=Path)
    p.add_argument("--out-val", type=Path)
    p.add_argument("--out-stats", required=True, type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.max_length <= 0:
        raise UserError(f"--max-length must be positive, got {args.max_length}")
    if args.val is not None and args.out_val is None:
        raise UserError("--val needs --out-val")
    if (args.train is None) != (args.out_train is None) or (args.train is None and args.val is None):
        raise UserError("give --train with --out-train, or --val with --out-val, or both")
    fields = fields_of(args)
    tokenizer, images = load_chat(args.tokenizer)
    fingerprint = tokenizer_fingerprint(args.tokenizer)
    splits = {"train": (args.train, args.out_train)} if args.train is not None else {}
    if args.val is not None:
        splits["val"] = (args.val, args.out_val)
    report = {"tokenizer": str(args.tokenizer), "tokenizer_fingerprint": fingerprint,
              "max_length": args.max_length, "too_long": args.too_long, "duplicates": args.duplicates,
              "reasoning": args.reasoning, "splits": {}}
    for split, (source, out) in splits.items():
        if split == "train" and args.parts:
            metadata = {"tokenizer_fingerprint": fingerprint, "max_length": str(args.max_length),
                        "too_long": args.too_long, "duplicates": args.duplicates, "reasoning": args.reasoning}
            stats, shards = merge_parts(args.parts, out_path=out, metadata=metadata, max_length=args.max_length,
                                        too_long=args.too_long)
            if Path(stats["source"]).resolve() != source.resolve():
                raise UserError(f"--parts are parts of {stats['source']}, not of --train {source}")
            if args.shards_out is not None:
                publish.write_text(args.shards_out, json.dumps({"shards": shards}, indent=2) + "\n")
        else:
            start, cpu = time.perf_counter(), time.process_time()
            stats = tokenize_file(source, tokenizer, out_path=out, max_length=args.max_length,
                                  too_long=args.too_long, fingerprint=fingerprint, split=split,
                                  duplicates=args.duplicates, images=images, reasoning=args.reasoning, fields=fields,
                                  drop=read_drop(args.drop) if split == "train" else None)
            if split == "train" and args.shards_out is not None:  # one job: the one shard
                shards = [{"shard": 0, "records": stats["records"], "seconds": round(time.perf_counter() - start, 2),
                           "cpu_seconds": round(time.process_time() - cpu, 2)}]
                publish.write_text(args.shards_out, json.dumps({"shards": shards}, indent=2) + "\n")
        report["splits"][split] = {"cache": str(out), **stats}
        print(f"{split}: {stats['records']} records, {stats['tokens']} tokens "
              f"({stats['supervised_tokens']} supervised), truncated {stats['truncated']}, "
              f"dropped {stats['dropped'] + stats['dropped_unsupervised']}, "
              f"duplicates dropped {stats['duplicates_dropped']}; {chat_counts_text(stats)} -> {out}")
    publish.write_text(args.out_stats, json.dumps(report, indent=2) + "\n")
    return 0
