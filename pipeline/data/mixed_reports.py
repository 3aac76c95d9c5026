"""The run-level data reports, from each training dataset's own.

    python -m pipeline mixed-reports --dataset chat=results/<run>/data/train/chat \\
        --dataset domain=results/<run>/data/train/domain [--val-stats results/<run>/data/val.stats.json] \\
        --out-json results/<run>/data/validation.json --out-csv results/<run>/data/validation.csv \\
        --out-stats results/<run>/data/stats.json

Each training dataset is validated and tokenized in jobs of its own (so adding
one validates and tokenizes only that one): its dir holds validation.json /
validation.csv (its records, and the val / test files checked with it, overlaps
between them included) and stats.json. The run keeps one validation.json,
validation.csv and stats.json for what reads them (the label page, the model
card, the user): with several datasets each is the split ``train:<name>``, val
and test appear once (they are the same in every dataset's report), and
``datasets`` names every dataset's file and own reports; a run of one training
file (a mix of one) has its reports as they are, the split ``train``.
``--out-shards`` collects each dataset's shards and their validation and
tokenization times (``<step>_shards.json`` beside its reports).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline import layout
from pipeline.errors import UserError
from pipeline.storage import publish

TRAIN = "train"


def split_name(dataset: str) -> str:
    """The split a training dataset is in the run's reports."""
    return f"{TRAIN}:{dataset}"


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read the dataset report {path}: {err}") from None


def _renamed(rows: list[dict], dataset: str) -> list[dict]:
    return [{**row, "split": split_name(dataset)} for row in rows if row.get("split") == TRAIN]


def merge_validation(reports: dict[str, dict]) -> dict:
    """One validation.json of the per-dataset ones (name -> report), in the datasets' order; one dataset's own."""
    first = next(iter(reports.values()))
    if len(reports) == 1:
        return first
    held_out = lambda key: [row for row in first.get(key, []) if row.get("split") != TRAIN]
    problems = [row for name, r in reports.items() for row in _renamed(r.get("problems", []), name)]
    problems += held_out("problems")
    counts: dict[str, int] = {}
    for row in problems:
        counts[row["reason"]] = counts.get(row["reason"], 0) + 1
    notes = list(dict.fromkeys(note for r in reports.values() for note in r.get("notes", [])))
    settings = {k: v for k, v in first.get("settings", {}).items() if k not in (TRAIN, "columns", "roles")}
    return {
        "ok": all(r.get("ok") for r in reports.values()),
        "num_problems": len(problems),
        "counts": dict(sorted(counts.items())),
        "settings": settings,
        "notes": notes,
        "files": {**{split_name(name): r["files"][TRAIN] for name, r in reports.items()},
                  **{split: stats for split, stats in first.get("files", {}).items() if split != TRAIN}},
        "problems": problems,
        "warnings": [row for name, r in reports.items() for row in _renamed(r.get("warnings", []), name)]
                    + held_out("warnings"),
        "datasets": {name: {"path": r.get("settings", {}).get(TRAIN),
                            **{key: r.get("settings", {}).get(key) for key in ("columns", "roles", "image_dir")}}
                     for name, r in reports.items()},
    }


def merge_stats(stats: dict[str, dict], val: dict | None) -> dict:
    """One stats.json of the per-dataset ones (name -> stats) and the validation set's."""
    first = next(iter(stats.values()))
    merged = {k: v for k, v in first.items() if k != "splits"}
    merged["splits"] = {(TRAIN if len(stats) == 1 else split_name(name)): s["splits"][TRAIN] for name, s in stats.items()}
    if val is not None:
        merged["splits"].update({k: v for k, v in val["splits"].items() if k != TRAIN})
    return merged


def merge_csv(csvs: dict[str, Path], out: Path) -> None:
    """The per-dataset problem tables as one, each training dataset's rows under its split name."""
    import pandas as pd

    if len(csvs) == 1:
        publish.write_text(out, next(iter(csvs.values())).read_text())
        return
    frames = []
    for i, (name, path) in enumerate(csvs.items()):
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
        held_out = frame["split"] != TRAIN
        frame.loc[~held_out, "split"] = split_name(name)
        frames.append(frame if i == 0 else frame[~held_out])  # val / test rows once
    table = pd.concat(frames, ignore_index=True)
    table = pd.concat([table[table["split"].str.startswith(TRAIN)], table[~table["split"].str.startswith(TRAIN)]])
    publish.write_text(out, table.to_csv(index=False))


def shard_times(dirs: dict[str, Path]) -> dict:
    """name -> {"shards": N, "validate": [...], "tokenize": [...]}: each shard's records and seconds, from the
    `<step>_shards.json` a dataset's validation and tokenization jobs write."""
    out = {}
    for name, d in dirs.items():
        steps = {step: _read(d / f"{step}_{layout.TRAIN_SET_SHARDS}")["shards"] for step in ("validate", "tokenize")}
        out[name] = {"shards": len(steps["validate"]), **steps}
    return out


def data_page(stats: dict[str, dict], times: dict) -> str:
    """The report's data page: per training dataset its file, kind, records and tokens, its shards, and each
    shard's validation and tokenization time (seconds; CPU seconds in brackets)."""
    import html

    rows, shard_rows = [], []
    for name, s in stats.items():
        split = s["splits"][TRAIN]
        rows.append([name, split["source"], split["records"], split["tokens"], times[name]["shards"]])
        for v, t in zip(times[name]["validate"], times[name]["tokenize"]):
            shard_rows.append([name, v["shard"], t["records"], f"{v['seconds']:.1f} ({v['cpu_seconds']:.1f})",
                               f"{t['seconds']:.1f} ({t['cpu_seconds']:.1f})"])

    def table(header: list[str], body: list[list]) -> str:
        cells = lambda row, tag: "".join(f"<{tag}>{html.escape(str(c))}</{tag}>" for c in row)
        return (f"<table><tr>{cells(header, 'th')}</tr>"
                + "".join(f"<tr>{cells(row, 'td')}</tr>" for row in body) + "</table>")

    return ("<!doctype html><html><head><meta charset='utf-8'><title>Training data</title><style>body{font-family:"
            "sans-serif;margin:2em}table{border-collapse:collapse;margin-bottom:1.5em}td,th{border:1px solid #ccc;"
            "padding:3px 8px;text-align:right}</style></head><body><h1>Training data</h1>"
            + table(["dataset", "file", "records", "tokens", "shards"], rows)
            + "<h2>Shards: records and seconds of each job (CPU seconds)</h2>"
            + table(["dataset", "shard", "records", "validation s", "tokenization s"], shard_rows)
            + "</body></html>\n")


def _dataset(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--dataset {text!r}: give name=dir")
    return name, Path(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline mixed-reports", description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", type=_dataset, action="append", required=True,
                    help="name=dir of a training dataset's validation.json, validation.csv and stats.json")
    ap.add_argument("--val-stats", type=Path, help="stats.json of the validation set's tokenization")
    ap.add_argument("--out-json", type=Path, required=True)
    ap.add_argument("--out-csv", type=Path, required=True)
    ap.add_argument("--out-stats", type=Path, required=True)
    ap.add_argument("--out-shards", type=Path, help="each dataset's shards and their times (JSON)")
    ap.add_argument("--out-html", type=Path, help="the report's data page: each dataset, its shards and their times")
    args = ap.parse_args(argv)
    dirs = dict(args.dataset)
    if len(dirs) != len(args.dataset):
        raise UserError(f"--dataset names repeat: {[name for name, _ in args.dataset]}")
    reports = {name: _read(d / layout.VALIDATION_JSON) for name, d in dirs.items()}
    stats = {name: _read(d / layout.STATS_FILE) for name, d in dirs.items()}
    val = _read(args.val_stats) if args.val_stats else None
    publish.write_text(args.out_json, json.dumps(merge_validation(reports), indent=2, ensure_ascii=False) + "\n")
    merge_csv({name: d / layout.VALIDATION_CSV for name, d in dirs.items()}, args.out_csv)
    publish.write_text(args.out_stats, json.dumps(merge_stats(stats, val), indent=2) + "\n")
    if args.out_shards is not None or args.out_html is not None:
        times = shard_times(dirs)
        if args.out_shards is not None:
            publish.write_text(args.out_shards, json.dumps(times, indent=2) + "\n")
        if args.out_html is not None:
            publish.write_text(args.out_html, data_page(stats, times))
    for name in dirs:
        split = stats[name]["splits"][TRAIN]
        print(f"{split_name(name)}: {split['records']} records, {split['tokens']} tokens ({split['source']})")
    return 0
