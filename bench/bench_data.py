"""Benchmark the data stages at scale: validate + tokenize 100k and 1M records, JSONL and Parquet, in bounded memory.

    python bench/bench_data.py                              # 100k and 1M train records, JSONL and Parquet
    python bench/bench_data.py --sizes 20000 200000         # quicker
    python bench/bench_data.py --smoke                      # 200 + 20 records, a temp dir: checks it runs

For each size and file kind it writes a synthetic ShareGPT train set (streamed:
JSON Lines line by line, Parquet with pyarrow a row group at a time) and a
val set of the same kind (1,000 records), then runs the two stages exactly as the
workflow does, each in its own process (``python -m pipeline validate`` /
``tokenize`` with the embedded demo tokenizer, one token per character),
and takes from the kernel (``wait4``) each process's wall time and peak RSS
(ru_maxrss: the high-water mark of its resident memory, imports included).

The records are a length mix: 70% one short exchange (~100 tokens), 25% two or
three exchanges with longer answers (~700), 5% one long answer (~2,500, over
max_length 1024: truncated); a fifth has a system prompt. Every record is
distinct (a serial number), so nothing is dropped as a duplicate and every
record is measured, hashed and cached.

Claim checked: the peak RSS of every stage stays under `RSS_BOUND_MB` at every
size, so it does not grow with the record count (the growth from the smallest
to the largest size is reported too). Results: bench/results/data.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
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
KINDS = {"jsonl": ".jsonl", "parquet": ".parquet"}
MAX_LENGTH = 1024
RSS_BOUND_MB = 1536  # the claim: no stage's peak RSS reaches this, at any size
GEN_ROWS = 10_000  # records per Parquet row group written


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _record(rng: random.Random, seed: int, i: int) -> dict:
    """One ShareGPT record of the length mix (see the module docstring)."""
    mix = rng.random()
    exchanges, answer = (1, (2, 12)) if mix < 0.70 else ((rng.choice((2, 3)), (20, 60)) if mix < 0.95
                                                           else (1, (350, 500)))
    turns = []
    for _ in range(exchanges):
        turns += [{"from": "human", "value": f"{seed}-{i}: {_sentence(rng, 3, 12)}?"},
                  {"from": "gpt", "value": _sentence(rng, *answer) + "."}]
    return {"id": f"{seed}-{i}", "conversations": turns,
            "system": "you answer briefly." if rng.random() < 0.2 else None}


def generate(path: Path, n: int, *, seed: int, kind: str) -> None:
    """`n` distinct records written as they are made (memory does not grow with `n`)."""
    rng = random.Random(seed)
    records = (_record(rng, seed, i) for i in range(n))
    if kind == "jsonl":
        with path.open("w") as f:
            for record in records:
                if record["system"] is None:
                    del record["system"]
                f.write(json.dumps(record) + "\n")
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    turn = pa.struct([("from", pa.string()), ("value", pa.string())])
    schema = pa.schema([("id", pa.string()), ("conversations", pa.list_(turn)), ("system", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        while chunk := [r for _, r in zip(range(GEN_ROWS), records)]:
            writer.write_table(pa.Table.from_pylist(chunk, schema=schema))


def run_stage(argv: list[str], log: Path) -> dict:
    """Run `python -m pipeline <argv>` as the workflow does; its wall seconds and peak RSS (MB) from wait4."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline", *argv], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"python -m pipeline {' '.join(argv)} failed ({proc.returncode}):\n{log.read_text()[-3000:]}")
    return {"seconds": seconds, "peak_rss_mb": usage.ru_maxrss / 1024}


def bench_one(tmp: Path, tok_dir: Path, n: int, kind: str, val_records: int) -> dict:
    """Generate, validate and tokenize one dataset; its figures. The files are removed after."""
    train, val = tmp / f"train{KINDS[kind]}", tmp / f"val{KINDS[kind]}"
    t0 = time.perf_counter()
    generate(train, n, seed=1, kind=kind)
    generate(val, val_records, seed=2, kind=kind)
    gen_s = time.perf_counter() - t0
    common = ["--train", str(train), "--val", str(val), "--tokenizer", str(tok_dir), "--max-length", str(MAX_LENGTH),
              "--too-long", "truncate", "--duplicates", "error", "--reasoning", "auto"]
    validate = run_stage(["validate", *common, "--out-json", str(tmp / "validation.json"),
                          "--out-csv", str(tmp / "validation.csv")], tmp / "validate.log")
    tokenize = run_stage(["tokenize", *common, "--out-train", str(tmp / "train.safetensors"),
                          "--out-val", str(tmp / "val.safetensors"), "--out-stats", str(tmp / "stats.json")],
                         tmp / "tokenize.log")
    stats = json.loads((tmp / "stats.json").read_text())["splits"]
    out = {"records": n + val_records, "kind": kind, "file_mb": (train.stat().st_size + val.stat().st_size) / 2**20,
           "cache_mb": sum((tmp / f"{s}.safetensors").stat().st_size for s in stats) / 2**20,
           "tokens": sum(s["tokens"] for s in stats.values()), "truncated": stats["train"]["truncated"],
           "tokens_per_record": stats["train"]["tokens_per_record"], "generate_s": gen_s,
           "validate": validate, "tokenize": tokenize}
    for p in tmp.iterdir():
        if p.is_file():
            p.unlink()
    return out


def report(results: list[dict], args, machine: str) -> list[str]:
    import tokenizers
    import transformers

    lines = [
        "# Data stages benchmark: validation + tokenization at scale, in bounded memory",
        "",
        f"Command: `{C.command_line(__file__)}` (from the repository root)",
        "",
        f"Machine: {machine}; Python {platform.python_version()}, transformers {transformers.__version__}, "
        f"tokenizers {tokenizers.__version__}, pipeline at commit {C.git_commit()}",
        "",
        f"Dataset: synthetic ShareGPT records, a length mix (70% ~100 tokens, 25% ~700, 5% ~2,500: truncated at "
        f"max_length {MAX_LENGTH}), train of the given size + {args.val_records:,} val records of the same kind; "
        "the embedded demo tokenizer (one token per character). Each stage is its own process "
        "(`python -m pipeline validate` / `tokenize`, as the workflow runs it); seconds and records/s include "
        "its start (~3 s of imports); peak RSS is the process's ru_maxrss (wait4).",
        "",
        "| phase | records | kind | seconds | records/s | tokens/s | peak RSS (MB) |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in results:
        for phase, name in (("validate", "validate (all checks, both reports)"),
                            ("tokenize", "tokenize (labels + safetensors caches)")):
            f = r[phase]
            lines.append(f"| {name} | {r['records']:,} | {r['kind']} | {f['seconds']:.1f} | "
                         f"{r['records'] / f['seconds']:,.0f} | {r['tokens'] / f['seconds']:,.0f} | "
                         f"{f['peak_rss_mb']:,.0f} |")
    peaks = [r[phase]["peak_rss_mb"] for r in results for phase in ("validate", "tokenize")]
    sizes = sorted({r["records"] for r in results})
    lines += ["", f"Peak RSS bound: every stage under {RSS_BOUND_MB:,} MB at every size: "
              f"{'**holds**' if max(peaks) < RSS_BOUND_MB else '**NOT met**'} (highest {max(peaks):,.0f} MB)."]
    if len(sizes) > 1:
        for kind in sorted({r["kind"] for r in results}, key=list(KINDS).index):  # the kinds this run measured
            for phase in ("validate", "tokenize"):
                small, large = (next(r[phase]["peak_rss_mb"] for r in results if r["records"] == s and r["kind"] == kind)
                                for s in (sizes[0], sizes[-1]))
                lines.append(f"- {kind} {phase}: {small:,.0f} MB at {sizes[0]:,} records, {large:,.0f} MB at "
                             f"{sizes[-1]:,} ({sizes[-1] / sizes[0]:.0f}x the records: +{large - small:,.0f} MB)")
    lines += ["", "| records | kind | file MiB | cache MiB | tokens | train tokens/record p50 / p99 / max | "
              "truncated | generation s |", "|---:|---|---:|---:|---:|---|---:|---:|"]
    for r in results:
        t = r["tokens_per_record"]
        lines.append(f"| {r['records']:,} | {r['kind']} | {r['file_mb']:,.1f} | {r['cache_mb']:,.1f} | "
                     f"{r['tokens']:,} | {t['p50']:.0f} / {t['p99']:.0f} / {t['max']} | {r['truncated']:,} | "
                     f"{r['generate_s']:.0f} |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000], help="train records per run")
    parser.add_argument("--val-records", type=int, default=1_000, help="val records per run (same kind)")
    parser.add_argument("--kinds", nargs="+", choices=sorted(KINDS), default=list(KINDS))
    parser.add_argument("--out", type=Path, default=C.RESULTS / "data.md")
    C.add_smoke(parser)
    args = parser.parse_args()
    machine = C.machine_text(C.machine())  # before we load the cores ourselves
    C.smoke(args, out="out", sizes=[200], val_records=20)

    from pipeline.demo.text import build_tokenizer

    results = []
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        tmp = Path(tmp)
        tok_dir = tmp / "tokenizer"
        build_tokenizer().save_pretrained(tok_dir)
        work = tmp / "work"
        work.mkdir()
        for n in args.sizes:
            for kind in args.kinds:
                results.append(bench_one(work, tok_dir, n, kind, args.val_records))
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    lines = report(results, args, machine)
    if C.SMOKE:
        lines = [C.SMOKE_BANNER, "", *lines]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    args.out.with_suffix(".json").write_text(json.dumps({"results": results, "rss_bound_mb": RSS_BOUND_MB},
                                                        indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
