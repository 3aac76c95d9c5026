"""Benchmark a training stage's data start-up at 1M records: the per-record counts, before and after.

    python bench/bench_stage_start.py                 # 1M records (~330 tokens each, a 2.5 GB cache)
    python bench/bench_stage_start.py --smoke         # 2,000 records: checks it runs

Every stage builds `TrainBatches` before its first update: it opens the token
cache and counts each record's supervised tokens (the loss is normalized by
the count of the whole global batch). Before (commit cf805b0) that count was a
Python loop over the records (`cache[i]`: two torch tensors per record); now
it is read from the cache's stored arrays (`TokenCache.supervised_counts`).
This times both on the same cache -- the loop as it was, verbatim -- and the
whole `TrainBatches` construction now, each in a fresh process (a cold page
cache is not forced: the cache file is read once before, as the tokenize job
that wrote it leaves it). The cache is synthetic (random tokens, the length
mix of bench/bench_data.py, ~60% of the tokens supervised): the time depends
on the records and tokens, not on what they say.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

# The loop every stage ran before (pipeline/train/batches.py at cf805b0), verbatim.
BEFORE = """
import numpy as np
from pipeline.data.cache import IGNORE_INDEX, TokenCache
def supervised_counts(cache) -> np.ndarray:
    return np.array([int((cache[i][1][1:] != IGNORE_INDEX).sum()) for i in range(len(cache))], dtype=np.int64)
"""
PROBES = {
    "before: supervised_counts (a loop over the records)": BEFORE + """
import sys, time
cache = TokenCache(sys.argv[1]); t = time.perf_counter(); counts = supervised_counts(cache)
print(time.perf_counter() - t, int(counts.sum()))
""",
    "after: supervised_counts (the stored arrays)": """
import sys, time
from pipeline.data.cache import TokenCache
from pipeline.train.batches import supervised_counts
cache = TokenCache(sys.argv[1]); t = time.perf_counter(); counts = supervised_counts(cache)
print(time.perf_counter() - t, int(counts.sum()))
""",
    "after: TrainBatches(...) whole (open the cache, counts, lengths, sampler)": """
import sys, time
from pipeline.data.cache import TokenCache
from pipeline.train.batches import TrainBatches
t = time.perf_counter()
class Collator:  # the stage's collator: only its cache is read at construction
    cache = TokenCache(sys.argv[1])
b = TrainBatches(Collator(), global_batch=64, micro_batch=4, seed=0, rank=0, world=1)
print(time.perf_counter() - t, int(b.counts.sum()))
""",
}


def build_cache(path: Path, n: int, seed: int = 0) -> dict:
    """A cache of `n` records of the length mix, written batch by batch (`CacheWriter`)."""
    from pipeline.data.cache import IGNORE_INDEX, CacheWriter

    rng = np.random.default_rng(seed)
    tokens = 0
    with CacheWriter(path) as writer:
        for start in range(0, n, 100_000):
            m = min(100_000, n - start)
            mix = rng.random(m)
            lengths = np.where(mix < 0.7, rng.integers(60, 140, m),
                               np.where(mix < 0.95, rng.integers(400, 1000, m), 1024)).astype(np.int64)
            ids = rng.integers(0, 32000, int(lengths.sum())).astype(np.int32)
            labels = np.where(rng.random(ids.size) < 0.6, ids, IGNORE_INDEX).astype(np.int32)
            writer.append(ids, labels, lengths)
            tokens += ids.size
        writer.close({"split": "train"})
    return {"records": n, "tokens": tokens, "mb": path.stat().st_size / 2**20}


def probe(code: str, cache: Path) -> dict:
    env = {"PYTHONPATH": str(REPO)}
    import os

    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, str(cache)], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, **env})
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    seconds, supervised = proc.stdout.split()
    return {"seconds": float(seconds), "supervised": int(supervised), "process_s": time.perf_counter() - t0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--out", type=Path, default=C.RESULTS / "stage_start.md")
    C.add_smoke(parser)
    args = parser.parse_args()
    machine = C.machine_text(C.machine())
    C.smoke(args, out="out", records=2_000)
    with tempfile.TemporaryDirectory(prefix="bench_start_") as tmp:
        cache = Path(tmp) / "train.safetensors"
        info = build_cache(cache, args.records)
        cache.read_bytes() if info["mb"] < 8192 else None  # warm the page cache, as the tokenize job leaves it
        results = {name: probe(code, cache) for name, code in PROBES.items()}
    sums = {r["supervised"] for r in results.values()}
    lines = [*([C.SMOKE_BANNER, ""] if C.SMOKE else []),
             "# Training stage start-up: per-record supervised counts at scale", "",
             f"Command: `{C.command_line(__file__)}` (from the repository root)", "",
             f"Machine: {machine}; pipeline at commit {C.git_commit()}", "",
             f"Cache: {info['records']:,} records, {info['tokens']:,} tokens ({info['mb']:,.0f} MiB), synthetic "
             "(see the script's docstring). Each row is a fresh process; seconds of the step itself (imports "
             "excluded), and of the whole process.", "",
             "| what | seconds | process seconds |", "|---|---:|---:|"]
    lines += [f"| {name} | {r['seconds']:,.2f} | {r['process_s']:,.1f} |" for name, r in results.items()]
    lines += ["", f"Same supervised-token total from each: {'yes' if len(sums) == 1 else '**no**'} "
              f"({next(iter(sums)):,})." if len(sums) == 1 else "", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    args.out.with_suffix(".json").write_text(json.dumps({"cache": info, "results": results}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
