"""Benchmark the data stages: validate + tokenize a generated 100k-record dataset.

    python bench/bench_data.py                      # 100k train + 2k val records
    python bench/bench_data.py --records 20000      # quicker
    python bench/bench_data.py --smoke              # 200 + 20 records, written to a temp dir: checks it runs

Generates a LLaVA/ShareGPT JSONL dataset (1-3 exchanges per record, a fifth
with a system prompt) and a small OpenAI-style JSON val set, then runs the two
CLI entry points in process (`pipeline.data.validate.main`,
`pipeline.data.tokenize.main`) with the demo tokenizer, and writes the timings,
the command and the machine to bench/results/data.md. Imports (transformers,
torch) are paid before the clock starts and reported separately.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey yankee zulu").split()


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def generate(path: Path, n: int, *, seed: int, openai: bool = False) -> None:
    """`n` distinct records (a serial number keeps them unique), JSONL or a JSON array."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        turns = []
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            turns += [("user", f"{seed}-{i}: {_sentence(rng, 3, 12)}?"), ("assistant", _sentence(rng, 2, 10) + ".")]
        system = "you answer briefly." if rng.random() < 0.2 else None
        if openai:
            messages = ([{"role": "system", "content": system}] if system else [])
            messages += [{"role": r, "content": t} for r, t in turns]
            records.append({"id": f"{seed}-{i}", "messages": messages})
        else:
            names = {"user": "human", "assistant": "gpt"}
            record = {"id": f"{seed}-{i}", "conversations": [{"from": names[r], "value": t} for r, t in turns]}
            if system:
                record["system"] = system
            records.append(record)
    with path.open("w") as f:
        if openai:
            json.dump(records, f)
        else:
            for record in records:
                f.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--val-records", type=int, default=2_000)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--out", type=Path, default=C.RESULTS / "data.md")
    C.add_smoke(parser)
    args = parser.parse_args()
    machine = C.machine_text(C.machine())  # before we load the cores ourselves (imports torch: after --help)
    C.smoke(args, out="out", records=200, val_records=20)

    t0 = time.perf_counter()
    import numpy as np  # noqa: F401
    import transformers
    import torch
    import tokenizers

    from pipeline.data import tokenize, validate
    from pipeline.data.cache import TokenCache
    from pipeline.demo.text import build_tokenizer
    import_s = time.perf_counter() - t0

    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        tmp = Path(tmp)
        tok_dir = tmp / "tokenizer"
        build_tokenizer().save_pretrained(tok_dir)
        train, val = tmp / "train.jsonl", tmp / "val.json"
        t0 = time.perf_counter()
        generate(train, args.records, seed=1)
        generate(val, args.val_records, seed=2, openai=True)
        gen_s = time.perf_counter() - t0
        n = args.records + args.val_records
        size_mb = (train.stat().st_size + val.stat().st_size) / 2**20

        common = ["--tokenizer", str(tok_dir), "--max-length", str(args.max_length), "--too-long", "truncate",
                  "--duplicates", "error", "--reasoning", "auto"]
        t0 = time.perf_counter()
        rc = validate.main(["--train", str(train), "--val", str(val), *common,
                            "--out-json", str(tmp / "validation.json"), "--out-csv", str(tmp / "validation.csv")])
        validate_s = time.perf_counter() - t0
        assert rc == 0

        t0 = time.perf_counter()
        rc = tokenize.main(["--train", str(train), "--val", str(val), *common,
                            "--out-train", str(tmp / "train.safetensors"), "--out-val", str(tmp / "val.safetensors"),
                            "--out-stats", str(tmp / "stats.json")])
        tokenize_s = time.perf_counter() - t0
        assert rc == 0
        stats = json.loads((tmp / "stats.json").read_text())["splits"]
        tokens = sum(s["tokens"] for s in stats.values())
        cache_mb = sum((tmp / f"{s}.safetensors").stat().st_size for s in stats) / 2**20

        t0 = time.perf_counter()
        cache = TokenCache(tmp / "train.safetensors")
        order = np.random.default_rng(0).permutation(len(cache))[:20_000]
        for i in order:
            cache[int(i)]
        read_s = time.perf_counter() - t0

    train_stats = stats["train"]
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, REPO), *sys.argv[1:]])
    lines = [
        "# Data stages benchmark",
        "",
        f"Command: `{command}` (from the repository root)",
        "",
        f"Machine: {machine}; Python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}",
        "",
        f"Dataset: {args.records:,} train records (ShareGPT JSONL) + {args.val_records:,} val records "
        f"(OpenAI JSON array), {size_mb:.1f} MiB; 1-3 exchanges per record, 20% with a system prompt. "
        f"Tokenizer: the demo char-level fast tokenizer (one token per character), max_length "
        f"{args.max_length}, too_long=truncate.",
        "",
        "| phase | records | seconds | records/s | tokens/s |",
        "|---|---:|---:|---:|---:|",
        f"| validate (all checks, both reports) | {n:,} | {validate_s:.1f} | {n / validate_s:,.0f} | "
        f"{tokens / validate_s:,.0f} |",
        f"| tokenize (labels + safetensors caches) | {n:,} | {tokenize_s:.1f} | {n / tokenize_s:,.0f} | "
        f"{tokens / tokenize_s:,.0f} |",
        f"| validate + tokenize | {n:,} | {validate_s + tokenize_s:.1f} | "
        f"{n / (validate_s + tokenize_s):,.0f} | |",
        f"| TokenCache random reads | {len(order):,} | {read_s:.2f} | {len(order) / read_s:,.0f} | |",
        "",
        f"Tokens: {tokens:,} ({train_stats['supervised_tokens']:,} supervised in train); train tokens per record "
        f"p50 {train_stats['tokens_per_record']['p50']:.0f}, p99 {train_stats['tokens_per_record']['p99']:.0f}, "
        f"max {train_stats['tokens_per_record']['max']}; truncated {train_stats['truncated']}. "
        f"Caches: {cache_mb:.1f} MiB.",
        "",
        f"Not timed: imports ({import_s:.1f} s, paid once per CLI process), dataset generation ({gen_s:.1f} s).",
        "",
    ]
    if C.SMOKE:
        lines = [C.SMOKE_BANNER, "", *lines]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
