"""Benchmark the data stages at scale: validate + tokenize 100k and 1M records, JSONL and Parquet, in bounded memory.

    python bench/bench_data.py                              # 100k and 1M train records, JSONL and Parquet
    python bench/bench_data.py --sizes 20000 200000         # quicker
    python bench/bench_data.py --smoke                      # 200 + 20 records, a temp dir: checks it runs
    python bench/bench_data.py --shards 1 2 4 --cores 2 2 2 --sizes 1000000 --kinds jsonl --out bench/results/data_shards.md
                                                            # sharded jobs: 1 vs 2 vs 4 shards on 2 cores

Sharded mode (``--shards``): the data jobs the workflow runs for one training
file of N shards, each a process of its own, at most ``--cores`` at once (as
``snakemake --cores C`` schedules them): N ``validate-shard`` jobs, then
``validate --scans`` (the merge, with the val file), then N ``tokenize-shard``
jobs and ``tokenize --parts`` (the merge) beside ``tokenize --val``; one shard
is the single ``validate`` and ``tokenize`` jobs. Per job: wall seconds, CPU
seconds (user + system, wait4) and peak RSS; per configuration: the wall time
of the whole, and the per-shard rate that the projection to 10M records on 32
SLURM CPU jobs is made from.

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


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def run_stage(argv: list[str], log: Path) -> dict:
    """Run `python -m pipeline <argv>` as the workflow does; its wall seconds, CPU seconds and peak RSS (MB) (wait4)."""
    return run_jobs([(argv, log)], cores=1)[0]


def run_jobs(jobs: list[tuple[list[str], Path]], cores: int) -> list[dict]:
    """Run the `python -m pipeline` jobs, at most `cores` at a time (as snakemake --cores schedules independent
    jobs); per job its wall seconds, CPU seconds (user + system) and peak RSS (MB), from wait4."""
    pending, running, results = list(enumerate(jobs)), {}, [None] * len(jobs)
    while pending or running:
        while pending and len(running) < cores:
            i, (argv, log) = pending.pop(0)
            out = log.open("w")
            proc = subprocess.Popen([sys.executable, "-m", "pipeline", *argv], cwd=REPO, env=_env(), stdout=out,
                                    stderr=subprocess.STDOUT)
            running[proc.pid] = (i, argv, log, out, time.perf_counter())
        pid, status, usage = os.wait4(-1, 0)
        if pid not in running:
            continue
        i, argv, log, out, t0 = running.pop(pid)
        out.close()
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"python -m pipeline {' '.join(argv)} failed:\n{log.read_text()[-3000:]}")
        results[i] = {"job": log.stem, "seconds": time.perf_counter() - t0,
                      "cpu_seconds": usage.ru_utime + usage.ru_stime, "peak_rss_mb": usage.ru_maxrss / 1024}
    return results


def bench_sharded(tmp: Path, tok_dir: Path, n: int, shards: int, cores: int, val_records: int) -> dict:
    """Validate and tokenize one JSON Lines train file of `n` records as `shards` shard jobs, `cores` at a time."""
    train, val = tmp / "train.jsonl", tmp / "val.jsonl"
    if not train.exists():
        generate(train, n, seed=1, kind="jsonl")
        generate(val, val_records, seed=2, kind="jsonl")
    common = ["--tokenizer", str(tok_dir), "--max-length", str(MAX_LENGTH), "--too-long", "truncate",
              "--reasoning", "auto"]
    run = tmp / "run"  # the same paths for every shard count: stats.json names the cache's
    run.mkdir(exist_ok=True)
    reports = ["--out-json", str(run / "validation.json"), "--out-csv", str(run / "validation.csv"),
               "--out-drop", str(run / "drop.npy")]
    t0 = time.perf_counter()
    phases = []
    if shards == 1:
        phases.append(run_jobs([(["validate", "--train", str(train), "--val", str(val), "--duplicates", "error",
                                  *common, *reports], run / "validate.log")], cores))
    else:
        phases.append(run_jobs([(["validate-shard", "--train", str(train), "--shard", f"{k}/{shards}", *common,
                                  "--out", str(run / f"scan{k}.json")], run / f"validate-shard{k}.log")
                                for k in range(shards)], cores))
        phases.append(run_jobs([(["validate", "--train", str(train), "--val", str(val), "--duplicates", "error",
                                  *common, *reports, "--scans", *(str(run / f"scan{k}.json") for k in range(shards))],
                                 run / "validate.log")], cores))
    tokenize = ["tokenize", "--train", str(train), "--duplicates", "error", *common, "--drop", str(run / "drop.npy"),
                "--out-train", str(run / "train.safetensors"), "--out-stats", str(run / "stats.json")]
    val_job = (["tokenize", "--val", str(val), "--duplicates", "error", *common, "--out-val",
                str(run / "val.safetensors"), "--out-stats", str(run / "val_stats.json")], run / "tokenize_val.log")
    if shards == 1:
        phases.append(run_jobs([(tokenize, run / "tokenize.log"), val_job], cores))
    else:
        phases.append(run_jobs([(["tokenize-shard", "--train", str(train), "--shard", f"{k}/{shards}",
                                  "--duplicates", "error", "--drop", str(run / "drop.npy"), *common,
                                  "--out", str(run / f"part{k}.safetensors")], run / f"tokenize-shard{k}.log")
                                for k in range(shards)] + [val_job], cores))
        phases.append(run_jobs([([*tokenize, "--parts", *(str(run / f"part{k}.safetensors") for k in range(shards)),
                                  "--shards-out", str(run / "shards.json")], run / "tokenize.log")], cores))
    wall = time.perf_counter() - t0
    out = {"records": n, "shards": shards, "cores": cores, "wall_s": wall,
           "jobs": [job for phase in phases for job in phase],
           "cache_sha256": _sha(run / "train.safetensors"), "stats_sha256": _sha(run / "stats.json"),
           "validation_sha256": _sha(run / "validation.json")}
    for p in run.iterdir():
        p.unlink()
    run.rmdir()
    return out


def _sha(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


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
    parser.add_argument("--shards", type=int, nargs="+", help="sharded mode: shard counts to run (one size, jsonl)")
    parser.add_argument("--cores", type=int, nargs="+", help="sharded mode: jobs at once, one per --shards entry")
    parser.add_argument("--rerender", action="store_true", help="sharded mode: the report again from its .json")
    parser.add_argument("--out", type=Path, default=C.RESULTS / "data.md")
    C.add_smoke(parser)
    args = parser.parse_args()
    machine = C.machine_text(C.machine())  # before we load the cores ourselves
    C.smoke(args, out="out", sizes=[200], val_records=20, **({"shards": [1, 2]} if args.shards else {}))

    from pipeline.demo.text import build_tokenizer

    if args.shards and args.rerender:
        return rerender(args, machine)
    if args.shards:
        return sharded_main(args, machine)
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
    _publish(args, report(results, args, machine), {"results": results, "rss_bound_mb": RSS_BOUND_MB})


def _publish(args, lines: list[str], payload: dict) -> None:
    """The report (args.out, .md) and its figures (.json beside it), printed too."""
    if C.SMOKE:
        lines = [C.SMOKE_BANNER, "", *lines]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    args.out.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    print("\n".join(lines))


def sharded_main(args, machine: str) -> None:
    from pipeline.demo.text import build_tokenizer

    cores = args.cores or [2] * len(args.shards)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        tmp = Path(tmp)
        build_tokenizer().save_pretrained(tmp / "tokenizer")
        for shards, c in zip(args.shards, cores):
            results.append(bench_sharded(tmp, tmp / "tokenizer", args.sizes[0], shards, c, args.val_records))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    _publish(args, sharded_report(results, args, machine), {"results": results})


def sharded_report(results: list[dict], args, machine: str) -> list[str]:
    lines = ["# Sharded data jobs: validation + tokenization of one training file as N shard jobs", "",
             f"Command: `{C.command_line(__file__)}` (from the repository root)", "",
             f"Machine: {machine}; pipeline at commit {C.git_commit()}; load average at the end "
             f"{C.load_average()}", "",
             f"Dataset: {results[0]['records']:,} synthetic ShareGPT train records (JSON Lines, the length mix of "
             f"bench/results/data.md) + {args.val_records:,} val records; the embedded demo tokenizer. Each job is "
             "a process of its own (`python -m pipeline ...`, the commands of the workflow's rules), at most "
             "`cores` at once.", "",
             "| shards | cores | wall s (all jobs) | cache == 1 shard's | job | wall s | CPU s | peak RSS MB |",
             "|---:|---:|---:|---|---|---:|---:|---:|"]
    base = results[0]
    for r in results:
        same = all(r[k] == base[k] for k in ("cache_sha256", "stats_sha256", "validation_sha256"))
        for i, job in enumerate(r["jobs"]):
            head = (f"| {r['shards']} | {r['cores']} | {r['wall_s']:,.0f} | {'yes' if same else '**no**'} "
                    if i == 0 else "| | | | ")
            lines.append(f"{head}| {job['job']} | {job['seconds']:,.0f} | {job['cpu_seconds']:,.0f} | "
                         f"{job['peak_rss_mb']:,.0f} |")
    lines += ["", *projection(results)]
    return lines + [""]


def projection(results: list[dict]) -> list[str]:
    """10M records on 32 SLURM CPU jobs, from measured CPU seconds (wall time is the machine's load's).

    A shard job's CPU is c_p per record it owns plus c_s per record it only reads past (each shard reads
    the whole file): the one-shard run gives c_p, the most-sharded run c_s (its shards together did the same
    work plus (N - 1) x n records read past). The merges' CPU per record is the most-sharded run's."""
    one = next((r for r in results if r["shards"] == 1), None)
    many = max(results, key=lambda x: x["shards"])
    if one is None or many["shards"] == 1:
        return []
    n, k = many["records"], many["shards"]
    cpu = lambda r, names: sum(j["cpu_seconds"] for j in r["jobs"] if j["job"].startswith(names))
    c_p = cpu(one, ("validate", "tokenize")) - cpu(one, ("tokenize_val",))
    c_p /= one["records"]
    sharded = cpu(many, ("validate-shard", "tokenize-shard"))
    c_s = max(sharded - n * c_p, 0.0) / ((k - 1) * n)
    merge = (cpu(many, ("validate",)) - cpu(many, ("validate-shard",))
             + cpu(many, ("tokenize",)) - cpu(many, ("tokenize-shard", "tokenize_val"))) / n
    target, jobs = 10_000_000, 32
    own, past = target // jobs, target - target // jobs
    per_job = own * c_p + past * c_s
    merged = target * merge
    return [f"Projection, 10M records on {jobs} SLURM CPU jobs (one core each), from CPU seconds (wall seconds "
            "also carry the machine's other load: the load averages above):",
            "",
            f"- per record a shard owns (validate + tokenize, 1-shard run): c_p = {c_p * 1e3:.3f} ms CPU;",
            f"- per record a shard only reads past ({k}-shard run: its shards spent {sharded:,.0f} s CPU, "
            f"{n:,} x c_p = {n * c_p:,.0f} s of it the work, the rest over {k - 1} x {n:,} records read past): "
            f"c_s = {c_s * 1e6:.1f} us CPU;",
            f"- the two merges ({k}-shard run): {merge * 1e6:.1f} us CPU a record.",
            "",
            f"One of {jobs} shard jobs at 10M: {own:,} x {c_p * 1e3:.3f} ms + {past:,} x {c_s * 1e6:.1f} us = "
            f"{own * c_p:,.0f} + {past * c_s:,.0f} = {per_job:,.0f} s; the merges {target:,} x {merge * 1e6:.1f} us "
            f"= {merged:,.0f} s. About {per_job + merged:,.0f} s ({(per_job + merged) / 60:.0f} min) with the "
            f"{jobs} jobs at once, against {target * c_p:,.0f} s ({target * c_p / 3600:.1f} h) for one job. "
            f"Reading past the others' records is {past * c_s / max(own * c_p, 1e-9):.0%} of a shard's own work "
            f"here (c_s is clamped at 0 where the sharded jobs spent no more than one job), but each shard "
            f"reads the whole file ({jobs} x its bytes from the file system). Not measured: cluster queueing, "
            "a shared file system's read rate."]


def rerender(args, machine: str) -> None:
    """The report again from its .json (a changed report, figures kept)."""
    results = json.loads(args.out.with_suffix(".json").read_text())["results"]
    kept = {line.split(":", 1)[0]: line for line in args.out.read_text().splitlines()
            if line.startswith(("Command:", "Machine:"))}  # the run's, not this re-rendering's
    lines = [kept.get(line.split(":", 1)[0], line) for line in sharded_report(results, args, machine)]
    lines[lines.index(kept["Command"])] += f" (report re-rendered by `{C.command_line(__file__)}`)"
    _publish(args, lines, {"results": results})

if __name__ == "__main__":
    main()
