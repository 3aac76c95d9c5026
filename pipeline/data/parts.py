"""A large training file tokenized by shard jobs, and their parts merged into the one cache a single job writes.

``python -m pipeline tokenize-shard`` encodes the records one shard owns
(`pipeline.data.shards`), less the duplicates validation found across shards
(``--drop``), into a *part*: a token cache of its kept records (`CacheWriter`)
and, beside it (``.json``), its counters (`SplitEncoder.counters`), the file
index of every kept record, and its time. `merge_parts` (``tokenize --parts``)
copies the parts' records back in file order, a block at a time, into the
split's cache and makes the split's stats of the summed counters and the kept
lengths (`tokenize.split_stats`): the same bytes and the same stats as one job,
in memory bounded by a block, never the split.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from pipeline.data.cache import CacheWriter, TokenCache
from pipeline.data.formats import format_problems
from pipeline.data.readers import fingerprint as file_fingerprint
from pipeline.data.shapes import fields_of
from pipeline.data.scan import add_job_arguments
from pipeline.data.shards import interleave, owns
from pipeline.data.tokenize import encode_file, load_chat, split_stats, tokenizer_fingerprint
from pipeline.errors import DataError, UserError
from pipeline.storage import publish

_SUMMED = ("records_in", "turns", "assistant_turns", "untrained_turns", "tokens", "supervised_tokens", "too_long",
           "truncated", "dropped", "dropped_unsupervised", "dropped_image_cut", "images", "eot_trained", "reasoning_records",
           "reasoning_dropped", "reasoning_dropped_by_template", "placeholders_trained",
           "stop_tokens_inside", "markers_in_prompts")


def part_info(part: str | Path) -> Path:
    """The ``.json`` beside a part's cache."""
    return Path(part).with_suffix(".json")


def tokenize_shard(path: str | Path, tokenizer, *, out_path: str | Path, shard: tuple[int, int], max_length: int,
                   too_long: str, duplicates: str, images=None, reasoning: str = "auto", fields=None,
                   drop: np.ndarray | None = None) -> dict:
    """Encode shard `shard` (k, n) of `path` into the part `out_path` (+ its .json); returns the .json's content.
    A record with a problem raises `DataError` listing this shard's problems (validation found them first)."""
    start, cpu = time.perf_counter(), time.process_time()
    path = Path(path)
    with CacheWriter(out_path) as writer:
        parsed, encoder, records_in, kept, failed = encode_file(
            path, tokenizer, writer, max_length=max_length, too_long=too_long, duplicates=duplicates, images=images,
            reasoning=reasoning, fields=fields, drop=drop, owns=owns(*shard) or (lambda index: True))
        if parsed.problems:
            raise DataError(format_problems(parsed.problems, header=f"{path} is not a valid dataset"))
        if failed is not None:
            raise failed
        counters = encoder.counters()
        counters.update(records_in=records_in)
        index = np.concatenate(encoder.kept_index) if encoder.kept_index else np.zeros(0, dtype=np.int64)
        writer.close({"split": "part", "source": str(path), "shard": f"{shard[0]}/{shard[1]}"})
    info = {"source": str(path), "shard": shard[0], "shards": shard[1], "records_seen": parsed.records_seen,
            "kept": kept, "counters": counters, "record_index": index.tolist(),
            "seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu}
    publish.write_text(part_info(out_path), json.dumps(info) + "\n")
    return info


def merge_parts(parts: list[str | Path], *, out_path: str | Path, metadata: dict, max_length: int, too_long: str
                ) -> tuple[dict, list[dict]]:
    """Every shard's part as one cache at `out_path` (records in file order) with `metadata` (plus ``records`` and
    ``supervised_tokens``); (the split's stats as `tokenize_file` gives them, each shard's records and times)."""
    infos = sorted((json.loads(part_info(p).read_text()) | {"part": str(p)} for p in parts), key=lambda i: i["shard"])
    n = infos[0]["shards"] if infos else 0
    if [i["shard"] for i in infos] != list(range(n)) or any(i["shards"] != n for i in infos):
        raise UserError(f"--parts: shards {[i['shard'] for i in infos]} given; every shard of {n} once is needed")
    source = infos[0]["source"]
    counters = _summed([i["counters"] for i in infos])
    caches = [TokenCache(i["part"]) for i in infos]
    indices = [np.asarray(i["record_index"], dtype=np.int64) for i in infos]
    with CacheWriter(out_path) as writer:
        lengths = []
        for shard, lo, hi in interleave(infos[0]["records_seen"], n):
            a, b = np.searchsorted(indices[shard], [lo, hi])
            if a < b:
                lengths.append(_copy(caches[shard], int(a), int(b), writer))
        lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
        encoded = split_stats(counters, lengths, source=source, max_length=max_length)
        records_in, kept = counters["records_in"], sum(i["kept"] for i in infos)
        if encoded["records"] == 0:
            copies = f"dropping {records_in - kept} duplicate(s) and " if kept < records_in else ""
            raise DataError(f"{source}: no records left after {copies}applying too_long={too_long!r} "
                            f"at max_length={max_length}")
        sha = file_fingerprint(source)
        stats = {"source": source, "source_sha256": sha, **encoded, "records_in": records_in,
                 "duplicates_dropped": records_in - kept}
        writer.close({"split": "train", "source": source, "source_sha256": sha, **metadata,
                      "records": str(encoded["records"]), "supervised_tokens": str(encoded["supervised_tokens"])})
    shards = [{"shard": i["shard"], "records": i["kept"], "seconds": round(i["seconds"], 2),
               "cpu_seconds": round(i["cpu_seconds"], 2)} for i in infos]
    return stats, shards


def _summed(counters: list[dict]) -> dict:
    out = {key: sum(c[key] for c in counters) for key in _SUMMED if key in counters[0]}
    out["max_tokens_before_truncation"] = max(c["max_tokens_before_truncation"] for c in counters)
    out["over"] = [tuple(entry) for c in counters for entry in c["over"]]
    return out


def _copy(cache: TokenCache, a: int, b: int, writer: CacheWriter) -> np.ndarray:
    """Records [a, b) of a part, appended to `writer`; their lengths. The tokens are read from the file, not
    through the part's memory map: mapped pages read stay resident, and would grow with the split."""
    lo, hi = int(cache._offsets[a]), int(cache._offsets[b])
    lengths = np.diff(cache._offsets[a:b + 1])
    images = [cache.images(i) for i in range(a, b)] if cache.has_images else None
    writer.append(_read(cache._input_ids, lo, hi), _read(cache._labels, lo, hi), lengths, images)
    return lengths


def _read(mapped: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Items [lo, hi) of a memory-mapped tensor, read from its file."""
    if hi <= lo or not isinstance(mapped, np.memmap):
        return np.asarray(mapped[lo:hi])
    return np.fromfile(mapped.filename, dtype=mapped.dtype, count=hi - lo, offset=mapped.offset + lo * mapped.itemsize)


def main(argv: list[str] | None = None) -> int:
    """`python -m pipeline tokenize-shard`: tokenize one shard of a training file into a part (`tokenize --parts`)."""
    p = argparse.ArgumentParser(prog="python -m pipeline tokenize-shard", description=main.__doc__.split(":")[1])
    add_job_arguments(p, duplicates=True)
    p.add_argument("--drop", type=Path, help="validate --out-drop: the copies duplicates=drop leaves out")
    p.add_argument("--out", required=True, type=Path, help="the part: a token cache, and its .json beside it")
    args = p.parse_args(argv)
    tokenizer, images = load_chat(args.tokenizer)
    tokenizer_fingerprint(args.tokenizer)  # a tokenizer dir without tokenizer files fails here, as tokenize does
    info = tokenize_shard(args.train, tokenizer, out_path=args.out, shard=args.shard, max_length=args.max_length,
                          too_long=args.too_long, duplicates=args.duplicates, images=images, reasoning=args.reasoning,
                          fields=fields_of(args), drop=read_drop(args.drop))
    k, n = args.shard
    print(f"train shard {k}/{n}: {info['kept']} records, {info['counters']['tokens']} tokens in "
          f"{info['seconds']:.1f} s ({info['cpu_seconds']:.1f} s CPU) -> {args.out}")
    return 0


def read_drop(path: Path | None) -> np.ndarray | None:
    """The sorted record indices of `validate --out-drop`; None without one."""
    return None if path is None else np.sort(np.load(path)).astype(np.int64)
