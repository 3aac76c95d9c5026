"""Validate every record of the dataset files and report every problem at once.

Checks, per file: the layout and each record's structure (see `formats`),
images (present and decodable), token length against ``max_length`` under the
too-long policy, duplicate ids, exact-duplicate samples; across files: val or
test conversations that also occur in train (and test in val).

Always writes ``validation.json`` (ok flag, counts per reason, the problems,
per-file stats) and ``validation.csv`` (one row per problem), then fails with a
`DataError` summarizing the first 20 problems if there are any. With the
``truncate`` / ``drop`` policies an over-long record is counted, not a problem.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.data.formats import ParsedFile, Problem, conversation_key, format_problems, parse_file
from pipeline.data.tokenize import TOO_LONG_POLICIES
from pipeline.errors import DataError, UserError

SPLITS = ("train", "val", "test")
CSV_COLUMNS = ["split", "file", "index", "line", "id", "field", "reason", "message"]

# Leading bytes of the image formats we accept when Pillow is not installed.
_IMAGE_MAGIC = (
    b"\x89PNG\r\n\x1a\n",  # PNG
    b"\xff\xd8\xff",  # JPEG
    b"GIF87a", b"GIF89a",
    b"BM",  # BMP
    b"II*\x00", b"MM\x00*",  # TIFF
)


@dataclass
class ValidationReport:
    """The outcome of `validate_dataset`; `problems` are tagged with their split."""

    problems: list[tuple[str, Problem]] = field(default_factory=list)
    files: dict[str, dict] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _, p in self.problems:
            counts[p.reason] = counts.get(p.reason, 0) + 1
        return dict(sorted(counts.items()))

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "num_problems": len(self.problems),
            "counts": self.counts(),
            "settings": self.settings,
            "files": self.files,
            "problems": [{"split": split, **p.to_dict()} for split, p in self.problems],
        }

    def summary(self, limit: int = 20) -> str:
        """The failure message: counts per reason, the first `limit` problems, the total."""
        counts = ", ".join(f"{reason}: {n}" for reason, n in self.counts().items())
        return format_problems([p for _, p in self.problems], header=f"dataset validation failed ({counts})",
                               limit=limit)


def validate_dataset(
    train: str | Path,
    *,
    val: str | Path | None = None,
    test: str | Path | None = None,
    tokenizer_dir: str | Path,
    max_length: int,
    too_long: str,
) -> ValidationReport:
    """Run every check on the given files; never raises for data problems (they go in the report)."""
    if too_long not in TOO_LONG_POLICIES:
        raise UserError(f"too_long must be one of {', '.join(TOO_LONG_POLICIES)}, not {too_long!r}")
    paths = {name: p for name, p in zip(SPLITS, (train, val, test)) if p is not None}
    report = ValidationReport(settings={
        "tokenizer": str(tokenizer_dir), "max_length": max_length, "too_long": too_long,
        **{name: str(p) for name, p in paths.items()},
    })
    parsed = {name: parse_file(p) for name, p in paths.items()}
    found: dict[str, list[Problem]] = {name: list(pf.problems) for name, pf in parsed.items()}

    image_verdicts: dict[str, tuple[str, str] | None] = {}  # an image shared by many records is read once
    for name, pf in parsed.items():
        found[name] += _image_problems(pf, image_verdicts)
        found[name] += _duplicate_problems(pf)
    for name, extra in _overlap_problems(parsed).items():
        found[name] += extra

    lengths = _measure_lengths(parsed, tokenizer_dir)
    for name, pf in parsed.items():
        stats = _file_stats(pf)
        if name in lengths:
            lens, errors = lengths[name]
            found[name] += [_problem(pf, i, "template_error", msg) for i, msg in errors.items()]
            stats.update(_length_stats(lens, max_length, too_long))
            if too_long == "error":
                found[name] += [
                    _problem(pf, i, "too_long", f"{n} tokens > max_length {max_length}")
                    for i, n in enumerate(lens) if n > max_length
                ]
        # File-level problems first, then by record.
        found[name].sort(key=lambda p: -1 if p.index is None else p.index)
        stats["problems"] = len(found[name])
        stats["records_valid"] = pf.records_seen - len({p.index for p in found[name] if p.index is not None})
        report.files[name] = stats
        report.problems += [(name, p) for p in found[name]]
    return report


def write_report(report: ValidationReport, out_json: str | Path, out_csv: str | Path) -> None:
    """Write both reports (also on failure: they are how the user finds every problem)."""
    import pandas as pd

    for path in (out_json, out_csv):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_json).write_text(json.dumps(report.to_json(), indent=2, ensure_ascii=False) + "\n")
    rows = [{"split": split, **p.to_dict()} for split, p in report.problems]
    frame = pd.DataFrame(rows, columns=CSV_COLUMNS)
    for column in ("index", "line"):
        frame[column] = frame[column].astype("Int64")  # integers with blanks, not floats
    frame.to_csv(out_csv, index=False)


# --- individual checks ----------------------------------------------------------------------------


def _problem(pf: ParsedFile, position: int, reason: str, message: str, field_: str | None = None) -> Problem:
    """A problem about the `position`-th clean record of `pf`."""
    record = pf.records[position]
    return Problem(str(pf.path), reason, message, index=record.index, line=record.line, id=record.id, field=field_)


def check_image(path: str) -> tuple[str, str] | None:
    """(reason, message) if the image at `path` is missing or cannot be decoded, else None.

    Uses Pillow when installed; otherwise the file must be non-empty and start
    with a known image signature.
    """
    if not os.path.isfile(path):
        return "image_missing", f"image file not found: {path}"
    try:
        from PIL import Image
    except ImportError:
        return None if _has_image_magic(path) else ("image_undecodable", f"not a known image format: {path}")
    try:
        with Image.open(path) as image:
            image.verify()
    except Exception as err:  # Pillow raises many types for a broken file
        return "image_undecodable", f"cannot decode image {path}: {err}"
    return None


def _has_image_magic(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(16)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return True
    return any(head.startswith(magic) for magic in _IMAGE_MAGIC)


def _image_problems(pf: ParsedFile, verdicts: dict) -> list[Problem]:
    problems = []
    for position, record in enumerate(pf.records):
        for j, image in enumerate(record.images):
            if image not in verdicts:
                verdicts[image] = check_image(image)
            if verdicts[image] is not None:
                reason, message = verdicts[image]
                problems.append(_problem(pf, position, reason, message, f"image[{j}]"))
    return problems


def _duplicate_problems(pf: ParsedFile) -> list[Problem]:
    """Repeated ids, and records identical to an earlier one (same messages and images)."""
    problems = []
    first_id: dict[str, int] = {}
    first_sample: dict[tuple, int] = {}
    for position, record in enumerate(pf.records):
        if record.id is not None:
            if record.id in first_id:
                earlier = pf.records[first_id[record.id]]
                problems.append(_problem(pf, position, "duplicate_id",
                                         f"id {record.id!r} is also used by record {earlier.index}", "id"))
            else:
                first_id[record.id] = position
        key = (conversation_key(record.messages), tuple(record.images))
        if key in first_sample:
            earlier = pf.records[first_sample[key]]
            problems.append(_problem(pf, position, "duplicate_sample",
                                     f"same conversation as record {earlier.index}"))
        else:
            first_sample[key] = position
    return problems


def _overlap_problems(parsed: dict[str, ParsedFile]) -> dict[str, list[Problem]]:
    """Val / test conversations that also occur in train (and test in val), whitespace-insensitive."""
    problems: dict[str, list[Problem]] = {}
    seen: dict[str, dict[str, int]] = {}
    for name in SPLITS:
        if name not in parsed:
            continue
        pf = parsed[name]
        keys = [conversation_key(r.messages, loose=True) for r in pf.records]
        found = []
        for position, key in enumerate(keys):
            for other, index_of in seen.items():
                if key in index_of:
                    earlier = parsed[other].records[index_of[key]]
                    found.append(_problem(pf, position, "split_overlap",
                                          f"same conversation as {other} record {earlier.index}"))
                    break
        problems[name] = found
        seen[name] = {}
        for position, key in enumerate(keys):
            seen[name].setdefault(key, position)
    return problems


def _measure_lengths(parsed: dict[str, ParsedFile], tokenizer_dir) -> dict[str, tuple[np.ndarray, dict]]:
    """Token lengths per clean record of each file; the tokenizer is loaded only if there is anything to measure."""
    if not any(pf.records for pf in parsed.values()):
        return {}
    from pipeline.data.tokenize import load_tokenizer, sequence_lengths  # imports transformers: only when needed

    tokenizer = load_tokenizer(tokenizer_dir)
    return {name: sequence_lengths(tokenizer, pf.records) for name, pf in parsed.items()}


def _file_stats(pf: ParsedFile) -> dict:
    return {"path": str(pf.path), "layout": pf.layout, "sha256": pf.sha256, "records": pf.records_seen,
            "images": sum(len(r.images) for r in pf.records)}


def _length_stats(lengths: np.ndarray, max_length: int, too_long: str) -> dict:
    measured = lengths[lengths >= 0]
    over = int((measured > max_length).sum())
    stats: dict = {"too_long": over}
    if too_long != "error":
        stats["truncated" if too_long == "truncate" else "dropped"] = over
    if measured.size:
        p50, p90, p99 = np.percentile(measured, [50, 90, 99])
        stats["tokens_per_record"] = {"p50": float(p50), "p90": float(p90), "p99": float(p99),
                                      "max": int(measured.max())}
    return stats


# --- CLI ------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline validate", description=__doc__.splitlines()[0])
    p.add_argument("--train", required=True, type=Path)
    p.add_argument("--val", type=Path)
    p.add_argument("--test", type=Path, help="held-out prompts (records with a reference answer)")
    p.add_argument("--tokenizer", required=True, type=Path)
    p.add_argument("--max-length", required=True, type=int)
    p.add_argument("--too-long", required=True, choices=TOO_LONG_POLICIES)
    p.add_argument("--out-json", required=True, type=Path)
    p.add_argument("--out-csv", required=True, type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.max_length <= 0:
        raise UserError(f"--max-length must be positive, got {args.max_length}")
    report = validate_dataset(args.train, val=args.val, test=args.test, tokenizer_dir=args.tokenizer,
                              max_length=args.max_length, too_long=args.too_long)
    write_report(report, args.out_json, args.out_csv)
    if not report.ok:
        raise DataError(f"{report.summary()}\nfull report: {args.out_json} and {args.out_csv}")
    for name, stats in report.files.items():
        extra = f", {stats['too_long']} over max_length ({args.too_long})" if stats.get("too_long") else ""
        print(f"{name}: {stats['records']} records ok ({stats['path']}){extra}")
    return 0
