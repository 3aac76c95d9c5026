"""Validate every record of the dataset files and report every problem at once.

Checks, per file: the layout and each record's structure (see `formats`: one
image placeholder per image, in user turns), images (present, decodable, of a
sane size: `pipeline.data.images`), token length against ``max_length`` under
the too-long policy (with a vision-language model's image tokens expanded as
tokenization will), duplicate ids, exact-duplicate samples under the
duplicates policy, and that at least one record is left to train on; across
files: val or test conversations that also occur in train (and test in val),
where a conversation with images is the same only with the same image files'
content. A record reports every defect it has: its image files are checked even
when its structure is already faulty (no ``<image>`` placeholder), images given
to a text-only model are a problem of their own (``images_on_text_model``), and a
plain text record in the test split is one (``text_in_test``: nothing to score).

Always writes ``validation.json`` (ok flag, counts per reason, the problems,
warnings, split-level notes, per-file stats) and ``validation.csv`` (one row per
problem), atomically, then fails with a `DataError` summarizing the problems if
there are any. With the ``truncate`` / ``drop`` too-long policies an over-long
record is counted, not a problem; with ``duplicates: warn`` / ``drop`` an exact
duplicate is counted (and, for ``drop``, left out of every later check, as
tokenization leaves it out of the cache), not a problem. A repeated ``id`` is a
problem under every policy.

What the chat template makes of the records is counted per split from the
training render tokenization uses (``eot_trained``, ``eot_not_trained``,
``reasoning_records``, ``reasoning_dropped`` and its split into
``reasoning_dropped_by_policy`` / ``reasoning_dropped_by_template``), and two
things the user did not ask for are warned about (stderr and ``warnings``, one
entry per split with its record count; the held-out test split is exempt):
reasoning the template does not render (``reasoning_not_rendered``) and
assistant turns whose end-of-turn marker is not trained (``eot_not_trained``).

Each file is streamed (`formats.stream_file`): its records are read and
checked a batch at a time, in one pass, with the splits in train, val, test
order so a split is checked against the ones before it. What is kept across a
file is bounded by its record count, never its text: a 24-byte digest per
distinct id and conversation (`stream.DigestIndex`, a second one of the loose
conversation for the later splits), one token length and four flags per
record (exact percentiles), and the problems found. Records with images keep
their image paths in the split-overlap index (images are compared by content).

A failed run also writes both reports to ``--failed-report-dir``, which the
workflow keeps out of Snakemake's declared outputs: Snakemake deletes the
outputs of a failed job, and the reports are the evidence of why it failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.data.formats import DUPLICATE_POLICIES, ParsedFile, Problem, Record, stream_file
from pipeline.data.readers import describe_kind
from pipeline.data.shapes import FieldMap, add_arguments as add_field_arguments, field_map
from pipeline.data.images import check_image, file_digest
from pipeline.data.vision import is_vision_language
from pipeline.data.stream import DigestIndex, batched, digest, loose_digest, sample_digest
from pipeline.data.chat import REASONING_POLICIES, REASONING_SETTING, SETTING, suggest_builtin
from pipeline.data.tokenize import BATCH_SIZE, CHAT_COUNTS, TOO_LONG_POLICIES
from pipeline.errors import DataError, UserError
from pipeline.storage import publish

SPLITS = ("train", "val", "test")
CSV_COLUMNS = ["split", "file", "kind", "index", "line", "id", "field", "reason", "message"]
REPORT_NAMES = ("validation.json", "validation.csv")  # the file names inside --failed-report-dir

# Image content digests, by path: a split-overlap candidate's images are read once.
_file_digest = functools.lru_cache(maxsize=1 << 16)(file_digest)

# Per-record overlap rows shown in the failure summary: the one line per pair of
# splits already gives the count, and the rows must not crowd out other faults.
OVERLAP_EXAMPLES = 3


@dataclass
class ValidationReport:
    """The outcome of `validate_dataset`; `problems` and `warnings` are tagged with their split.

    `notes` are split-level findings, one line each, shown above the problems in
    the failure summary: one per pair of splits that share conversations, and
    one per split left with no usable record when every record has its own
    problem (otherwise that is the `no_usable_records` problem itself).
    `warnings` are faults the user chose to keep (``duplicates: warn``).
    """

    problems: list[tuple[str, Problem]] = field(default_factory=list)
    warnings: list[tuple[str, Problem]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
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
            "notes": self.notes,
            "files": self.files,
            "problems": [{"split": split, **p.to_dict()} for split, p in self.problems],
            "warnings": [{"split": split, **p.to_dict()} for split, p in self.warnings],
        }

    def summary(self, limit: int = 20) -> str:
        """The failure message: counts per reason, the notes, up to `limit` problems, the total.

        Problems are listed file-level first, then by record, with at most
        `OVERLAP_EXAMPLES` split-overlap rows at the end (the notes count them
        per pair of splits), so a val that copies train cannot hide the rest.
        """
        counts = ", ".join(f"{reason}: {n}" for reason, n in self.counts().items())
        lines = [f"dataset validation failed ({counts}): {len(self.problems)} problem(s)"]
        lines += [f"  {note}" for note in self.notes]
        shown = self._summary_problems(limit)
        lines += [f"  {p.describe()}" for p in shown]
        if len(self.problems) > len(shown):
            lines.append(f"  ... and {len(self.problems) - len(shown)} more")
        return "\n".join(lines)

    def _summary_problems(self, limit: int) -> list[Problem]:
        others = [p for _, p in self.problems if p.reason != "split_overlap"]
        others.sort(key=lambda p: p.index is not None)  # stable: file-level faults of every split first
        overlaps = [p for _, p in self.problems if p.reason == "split_overlap"]
        return (others + overlaps[:OVERLAP_EXAMPLES])[:limit]


def validate_dataset(
    train: str | Path,
    *,
    val: str | Path | None = None,
    test: str | Path | None = None,
    tokenizer_dir: str | Path,
    max_length: int,
    too_long: str,
    duplicates: str = "error",
    reasoning: str = "auto",
    fields: FieldMap | None = None,
) -> ValidationReport:
    """Run every check on the given files; never raises for data problems (they go in the report).

    `fields`: the dataset's own key and role names (`pipeline.data.shapes.FieldMap`).
    Raises `UserError` for an unknown policy or a tokenizer that cannot be loaded.
    """
    fields = fields or FieldMap()
    _check_policy("too_long", too_long, TOO_LONG_POLICIES)
    _check_policy("duplicates", duplicates, DUPLICATE_POLICIES)
    paths = {name: p for name, p in zip(SPLITS, (train, val, test)) if p is not None}
    report = ValidationReport(settings={
        "tokenizer": str(tokenizer_dir), "max_length": max_length, "too_long": too_long, "duplicates": duplicates,
        "reasoning": reasoning, "columns": fields.columns, "roles": fields.roles,
        **{name: str(p) for name, p in paths.items()},
    })
    scans: dict[str, _SplitScan] = {}
    image_verdicts: dict[str, tuple[str, str] | None] = {}  # an image shared by many records is read once
    text_only = Path(tokenizer_dir).is_dir() and not is_vision_language(tokenizer_dir)
    measure = _Measure(tokenizer_dir, reasoning, image_verdicts)
    for name, path in paths.items():  # in SPLITS order: a split is checked against the ones before it
        scan = _SplitScan(name, *stream_file(path, fields))
        for batch in batched(scan.stream, BATCH_SIZE):
            _check_batch(scan, batch, scans, measure, image_verdicts, text_only, duplicates=duplicates,
                         max_length=max_length, too_long=too_long)
        if scan.pf.rejected:  # records rejected after the last clean one: their images are still checked
            _check_batch(scan, [], scans, measure, image_verdicts, text_only, duplicates=duplicates,
                         max_length=max_length, too_long=too_long)
        scan.finish()
        scans[name] = scan
    for scan in scans.values():
        report.warnings += [(scan.name, p) for p in scan.copies if duplicates == "warn"]
    overlaps = [(name, other, p) for name, scan in scans.items() for other, p in scan.overlaps]
    report.notes += _overlap_notes({name: scan.pf for name, scan in scans.items()}, overlaps)

    for name, scan in scans.items():
        pf, found = scan.pf, scan.found
        stats = {"path": str(pf.path), "kind": pf.layout, "sha256": pf.sha256, "records": pf.records_seen,
                 "images": scan.images, "duplicates": len(scan.copies),
                 "duplicates_dropped": len(scan.copies) if duplicates == "drop" else 0,
                 "overlaps": dict(Counter(other for other, _ in scan.overlaps))}
        if measure.loaded:
            lengths, flags = scan.measured()
            stats.update(_length_stats(lengths, max_length, too_long))
            stats.update(_chat_stats(lengths, flags))
            if name != "test":  # held-out prompts are not trained: what the template drops there costs nothing
                report.warnings += [(name, w) for w in _chat_warnings(pf, name, scan.chat_hits, measure.template)]
        stats["records_valid"] = pf.records_seen - scan.with_problems
        causes = scan.causes if too_long == "drop" else {**scan.causes, "too_long": 0}
        stats["records_usable"] = pf.records_seen - sum(causes.values())
        if pf.records_seen and not stats["records_usable"]:
            why = f"no usable record is left: {_unusable_text(pf.records_seen, causes, max_length)}"
            if causes["problem"] == pf.records_seen:
                report.notes.append(f"{pf.path}: {why}")  # each record's own problem is listed already
            else:
                found.append(Problem(str(pf.path), "no_usable_records", why, kind=pf.layout))
        # File-level problems first, then by record.
        found.sort(key=lambda p: -1 if p.index is None else p.index)
        stats["problems"] = len(found)
        report.files[name] = stats
        report.problems += [(name, p) for p in found]
    return report


class _SplitScan:
    """One split as it streams past: its problems (O(faults)), running counts, and what later splits are
    checked against -- 24-byte digests (`DigestIndex`) and one length and four flags per record, no record."""

    def __init__(self, name: str, pf: ParsedFile, stream):
        self.name, self.pf, self.stream = name, pf, stream
        self.found: list[Problem] = []  # this split's problems, in the order the checks find them
        self.copies: list[Problem] = []  # exact duplicates (the duplicates policy decides what they are)
        self.overlaps: list[tuple[str, Problem]] = []  # (earlier split, problem)
        self.ids, self.samples, self.texts = DigestIndex(), DigestIndex(), DigestIndex()
        self.texts_with_images: dict[bytes, list[tuple[tuple[str, ...], int]]] = {}
        self.lengths: list[np.ndarray] = []
        self.flags: list[np.ndarray] = []
        self.chat_hits: dict[str, list] = {}  # warning reason -> [records, first record]
        self.images = 0
        self.with_problems = 0  # records with any problem (split overlaps too)
        self.causes = {"problem": 0, "duplicate": 0, "too_long": 0}  # why records will not reach the cache

    def finish(self) -> None:
        """Add the file's own problems (complete once the stream is read) in front of the records' ones."""
        parse = [p for p in self.pf.problems]
        broken = {p.index for p in parse if p.index is not None}
        self.with_problems += len(broken)
        self.causes["problem"] += len(broken)
        self.found = parse + self.found

    def measured(self) -> tuple[np.ndarray, np.ndarray]:
        """(token length per measured record, -1 where it is not measurable; its `CHAT_COUNTS` flags)."""
        if not self.lengths:
            return np.zeros(0, dtype=np.int64), np.zeros((0, len(CHAT_COUNTS)), dtype=bool)
        return np.concatenate(self.lengths), np.concatenate(self.flags)


def _check_batch(scan: _SplitScan, batch: list[Record], scans: dict[str, _SplitScan], measure: "_Measure",
                 image_verdicts: dict, text_only: bool, *, duplicates: str, max_length: int, too_long: str) -> None:
    """Every check on one batch of a split's clean records, in the order `validate_dataset` reports them,
    and the image checks of the records rejected since the last batch (`ParsedFile.rejected`: their other
    defects are the file's problems, counted once, in `_SplitScan.finish`)."""
    rejected, scan.pf.rejected[:] = list(scan.pf.rejected), []
    # the per-record checks locate records by batch position
    pf = dataclasses.replace(scan.pf, records=batch, rejected=rejected)
    found = _duplicate_id_problems(pf, scan.ids)
    copies = _duplicate_sample_problems(pf, scan.samples)
    scan.copies += copies
    dropped: set[int] = set()
    if duplicates == "error":
        found += copies
    elif duplicates == "drop":  # check what tokenization will keep: a dropped copy is neither measured nor an overlap
        dropped = {p.index for p in copies}
        pf = dataclasses.replace(pf, records=[r for r in batch if r.index not in dropped])
    scan.images += sum(len(r.images) for r in pf.records)
    found += _image_problems(pf, image_verdicts, text_only) + _split_record_problems(pf, scan.name)
    overlaps = _overlap_problems(scan, pf, scans, image_verdicts)
    scan.overlaps += overlaps
    found += [p for _, p in overlaps]
    over_long: set[int] = set()
    if pf.records:
        lengths, errors, flags = measure(pf)
        problems, _, over_long = _length_check(pf, lengths, errors, max_length, too_long)
        found += problems
        scan.lengths.append(lengths)
        scan.flags.append(flags)
        for reason, hit in _chat_hit_masks(lengths, flags).items():
            positions = np.flatnonzero(hit)
            if positions.size:
                entry = scan.chat_hits.setdefault(reason, [0, pf.records[positions[0]]])
                entry[0] += positions.size
    scan.found += found
    counted = {r.index for r in rejected}  # already among the records with problems
    scan.with_problems += len({p.index for p in found} - counted)
    broken = {p.index for p in found if p.reason != "split_overlap"} - counted
    scan.causes["problem"] += len(broken)
    scan.causes["duplicate"] += len(dropped - broken)
    scan.causes["too_long"] += len(over_long - broken - dropped)


class _Measure:
    """Token lengths and chat flags of a batch, as tokenization will count them (`sequence_lengths`); the
    tokenizer is loaded at the first batch that has records, so a dataset with none never loads it.

    A vision-language model's records are measured with their image tokens
    expanded, except where an image is unusable (already a problem): -1 there.
    """

    def __init__(self, tokenizer_dir, reasoning: str, image_verdicts: dict):
        self.tokenizer_dir, self.reasoning, self.image_verdicts = tokenizer_dir, reasoning, image_verdicts
        self.loaded = False
        self.template = ""

    def __call__(self, pf: ParsedFile) -> tuple[np.ndarray, dict[int, str], np.ndarray]:
        from pipeline.data.tokenize import load_chat, sequence_lengths  # imports transformers: only when needed

        if not self.loaded:
            self.tokenizer, self.images = load_chat(self.tokenizer_dir)
            self.template = (self.images.chat_template if self.images else self.tokenizer.chat_template) or ""
            self.loaded = True
        usable = [i for i, r in enumerate(pf.records) if self.images is None
                  or all(self.image_verdicts.get(p) is None for p in r.images)]
        measured, errors, measured_flags = sequence_lengths(self.tokenizer, [pf.records[i] for i in usable],
                                                            self.images, reasoning=self.reasoning)
        lengths = np.full(len(pf.records), -1, dtype=np.int64)
        lengths[usable] = measured
        flags = np.zeros((len(pf.records), len(CHAT_COUNTS)), dtype=bool)
        flags[usable] = measured_flags
        return lengths, {usable[i]: msg for i, msg in errors.items()}, flags


def write_report(report: ValidationReport, out_json: str | Path, out_csv: str | Path) -> None:
    """Write both reports (also on failure: they are how the user finds every problem).

    Each file is written to a temporary name and renamed into place, so a
    reader never sees half a report, and a crash never leaves one.
    """
    import pandas as pd

    publish.write_text(out_json, json.dumps(report.to_json(), indent=2, ensure_ascii=False) + "\n")
    rows = [{"split": split, **p.to_dict()} for split, p in report.problems]
    frame = pd.DataFrame(rows, columns=CSV_COLUMNS)
    for column in ("index", "line"):
        frame[column] = frame[column].astype("Int64")  # integers with blanks, not floats
    publish.write_text(out_csv, frame.to_csv(index=False))


def failed_report_paths(directory: str | Path) -> tuple[Path, Path]:
    """Where a failed run leaves validation.json and validation.csv inside `directory`."""
    return tuple(Path(directory) / name for name in REPORT_NAMES)


def remove_failed_reports(directory: str | Path) -> None:
    """Delete the reports an earlier failed attempt left in `directory`, then the directory if now empty.

    Only our own two files are removed, never the directory's other content:
    the directory is a command-line argument, and a mistyped one must not
    cost the user anything.
    """
    for path in failed_report_paths(directory):
        path.unlink(missing_ok=True)
    try:
        Path(directory).rmdir()
    except OSError:  # absent, or holds something else: leave it
        pass


def _check_policy(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UserError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")


# --- individual checks ----------------------------------------------------------------------------


def _problem(pf: ParsedFile, position: int, reason: str, message: str, field_: str | None = None) -> Problem:
    """A problem about the `position`-th clean record of `pf`."""
    return _record_problem(pf, pf.records[position], reason, message, field_)


def _record_problem(pf: ParsedFile, record: Record, reason: str, message: str, field_: str | None = None) -> Problem:
    """A problem about `record` of `pf` (clean or rejected)."""
    return Problem(str(pf.path), reason, message, index=record.index, line=record.line, id=record.id, field=field_,
                   kind=pf.layout)


def _image_problems(pf: ParsedFile, verdicts: dict, text_only: bool = False) -> list[Problem]:
    """Every unreadable image of every record, those already rejected for another defect included
    (a record reports all its defects at once); with `text_only`, one problem per record with images."""
    problems = []
    for record in sorted(pf.records + pf.rejected, key=lambda r: r.index):
        if text_only and record.images:
            problems.append(_record_problem(
                pf, record, "images_on_text_model", f"{len(record.images)} image(s) given to a text-only model (its "
                "tokenizer dir has no image processor): images need a vision-language model; remove them, or "
                "train a vision-language model", "image"))
        for j, image in enumerate(record.images):
            if image not in verdicts:
                verdicts[image] = check_image(image)
            if verdicts[image] is not None:
                reason, message = verdicts[image]
                problems.append(_record_problem(pf, record, reason, message, f"image[{j}]"))
    return problems


def _split_record_problems(pf: ParsedFile, split: str) -> list[Problem]:
    """Records a split cannot use: a test record needs a prompt and a reference answer, which plain text has not."""
    if split != "test":
        return []
    return [_record_problem(pf, r, "text_in_test", "a plain text record has no prompt and reference answer to "
                            "score: the test split holds conversations (data.test: null skips it)", "text")
            for r in pf.records if r.is_text]


def _duplicate_id_problems(pf: ParsedFile, seen: DigestIndex) -> list[Problem]:
    """Every record whose id an earlier record already uses (`seen`: the split's ids so far): an id is meant
    to be unique, whatever the policy."""
    with_id = [(position, r) for position, r in enumerate(pf.records) if r.id is not None]
    earlier = seen.first([digest(r.id) for _, r in with_id], [r.index for _, r in with_id])
    return [_problem(pf, position, "duplicate_id", f"id {r.id!r} is also used by record {e}", "id")
            for (position, r), e in zip(with_id, earlier) if e is not None]


def _duplicate_sample_problems(pf: ParsedFile, seen: DigestIndex) -> list[Problem]:
    """Every record identical to an earlier one (same messages and images, `formats.duplicate_of`; `seen`:
    the split's conversations so far); the duplicates policy decides their fate."""
    earlier = seen.first([sample_digest(r) for r in pf.records], [r.index for r in pf.records])
    return [_problem(pf, position, "duplicate_sample", f"same conversation as record {e}")
            for position, e in enumerate(earlier) if e is not None]


def _overlap_problems(scan: _SplitScan, pf: ParsedFile, earlier: dict[str, _SplitScan], image_verdicts: dict
                      ) -> list[tuple[str, Problem]]:
    """(earlier split, problem) per record of `pf` (a batch of `scan`'s split) whose conversation occurs in an
    earlier split (val: train; test: train or val); the batch is then remembered for the later splits.

    Whitespace-insensitive; a record with images matches only a record with
    the same image content (under any file name): images are read only for a
    text that occurs in both splits; a record is matched to the first split it
    occurs in, and to that split's first such record. `image_verdicts`: path
    -> problem or None (`check_image`), an unreadable image is compared by its path.
    """
    texts = [loose_digest(r) for r in pf.records]
    found: list[tuple[str, Problem]] = []
    matches: list[int | None] = [None] * len(texts)
    for other, prior in earlier.items():
        plain = [i for i, r in enumerate(pf.records) if not r.images and matches[i] is None]
        for i, index in zip(plain, prior.texts.first([texts[i] for i in plain], [0] * len(plain), add=False)):
            if index is not None:
                matches[i] = (other, index)
        for i, r in enumerate(pf.records):
            if r.images and matches[i] is None and texts[i] in prior.texts_with_images:
                key = _image_key(r.images, image_verdicts)
                index = next((index for paths, index in prior.texts_with_images[texts[i]]
                              if _image_key(paths, image_verdicts) == key), None)
                if index is not None:
                    matches[i] = (other, index)
    for position, match in enumerate(matches):
        if match is not None:
            other, index = match
            found.append((other, _problem(pf, position, "split_overlap", f"same conversation as {other} record {index}")))
    if scan.name != SPLITS[-1]:  # the last split is no later split's "earlier"
        plain = [i for i, r in enumerate(pf.records) if not r.images]
        scan.texts.first([texts[i] for i in plain], [pf.records[i].index for i in plain])
        for i, r in enumerate(pf.records):
            if r.images:
                entries = scan.texts_with_images.setdefault(texts[i], [])
                if all(paths != tuple(r.images) for paths, _ in entries):
                    entries.append((tuple(r.images), r.index))
    return found


def _image_key(paths, image_verdicts: dict) -> tuple[str, ...]:
    """The images' content digests (an unreadable image: its path), to compare records across splits."""
    return tuple(path if image_verdicts.get(path) is not None else _file_digest(path) for path in paths)


def _overlap_notes(parsed: dict[str, ParsedFile], overlaps: list[tuple[str, str, Problem]]) -> list[str]:
    """One line per pair of splits that share conversations, e.g. 'val: 128 of 128 records also occur in train'.

    Says so when both splits are the same file (same resolved path) or copies
    of it (same sha256): the usual cause of a complete overlap.
    """
    notes = []
    for (split, other), n in Counter((split, other) for split, other, _ in overlaps).items():
        pf, source = parsed[split], parsed[other]
        note = f"{split}: {n} of {pf.records_seen} records also occur in {other}"
        if pf.path.resolve() == source.path.resolve():
            note += f" (same file as {other}: {source.path})"
        elif pf.sha256 == source.sha256:
            note += f" ({split} is a copy of {other}: same content as {source.path})"
        notes.append(note)
    return notes


# Why a record does not reach the token cache, as (one record, several records).
_UNUSABLE_PHRASES = {
    "problem": ("has a problem", "have problems"),
    "duplicate": ("is a copy of an earlier record and duplicates=drop",
                  "are copies of earlier records and duplicates=drop"),
    "too_long": ("is over max_length {max_length} and too_long=drop",
                 "are over max_length {max_length} and too_long=drop"),
}


def _unusable_causes(broken: set[int], dropped_copies: set[int], dropped_long: set[int]) -> dict[str, int]:
    """Records that will not reach the cache, by first cause (the keys of `_UNUSABLE_PHRASES`); each counted once."""
    return {
        "problem": len(broken),
        "duplicate": len(dropped_copies - broken),
        "too_long": len(dropped_long - broken - dropped_copies),
    }


def _unusable_text(total: int, causes: dict[str, int], max_length: int) -> str:
    """Why none of `total` records is usable, e.g. 'all 200 records are over max_length 128 and too_long=drop'."""
    def phrase(cause: str, n: int) -> str:
        return _UNUSABLE_PHRASES[cause][n != 1].format(max_length=max_length)

    present = [(cause, n) for cause, n in causes.items() if n]
    if len(present) == 1:
        subject = "its only record" if total == 1 else f"all {total} records"
        return f"{subject} {phrase(present[0][0], total)}"
    return f"of its {total} records, " + ", ".join(f"{n} {phrase(cause, n)}" for cause, n in present)


def _length_check(
    pf: ParsedFile, lengths: np.ndarray, errors: dict[int, str], max_length: int, too_long: str,
) -> tuple[list[Problem], dict, set[int]]:
    """(template failures and, under too_long=error, over-long records as problems; length stats;
    the file indices of the records over `max_length`)."""
    problems = [_problem(pf, i, "template_error", msg) for i, msg in errors.items()]
    over = np.flatnonzero(lengths > max_length)
    if too_long == "error":
        problems += [_problem(pf, i, "too_long", f"{lengths[i]} tokens > max_length {max_length}") for i in over]
    return problems, _length_stats(lengths, max_length, too_long), {pf.records[i].index for i in over}


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


def _chat_stats(lengths: np.ndarray, flags: np.ndarray) -> dict:
    """The `CHAT_COUNTS` of one split's records as rendered for training, those with an end-of-turn marker
    not trained, and those whose reasoning the policy dropped."""
    counts = {key: int(n) for key, n in zip(CHAT_COUNTS, flags.sum(axis=0))}
    counts["eot_not_trained"] = int((lengths >= 0).sum()) - counts["eot_trained"]
    counts["reasoning_dropped_by_policy"] = counts["reasoning_dropped"] - counts["reasoning_dropped_by_template"]
    return counts


# Chat warnings: a split's records train less than the data holds, and the user did not ask for it.
REASONING_NOT_RENDERED = "reasoning_not_rendered"
EOT_NOT_TRAINED = "eot_not_trained"


def _reasoning_fix(template: str) -> str:
    """How to train the reasoning a template drops: the built-in template of its family that renders it."""
    if "<｜Assistant｜>" in template:
        fit = "deepseek-r1"
    elif "<|channel|>" in template:
        fit = "gpt-oss"
    elif "<think>" in template or "<|im_start|>" in template:
        fit = "qwen3-thinking"
    else:
        return (f"set {SETTING} to a built-in template that renders it (qwen3-thinking, deepseek-r1, gpt-oss) or "
                "a .jinja file that does, to train it")
    return f"set {SETTING}: {fit} to train it"


def _chat_hit_masks(lengths: np.ndarray, flags: np.ndarray) -> dict[str, np.ndarray]:
    """Per chat warning, which records it concerns: reasoning the template does not render, and an
    end-of-turn marker not trained (of the records rendered)."""
    eot_trained, _, _, by_template = (flags[:, CHAT_COUNTS.index(k)] for k in CHAT_COUNTS)
    return {REASONING_NOT_RENDERED: by_template, EOT_NOT_TRAINED: (lengths >= 0) & ~eot_trained}


def _chat_warnings(pf: ParsedFile, split: str, hits: dict[str, list], template: str) -> list[Problem]:
    """File-level warnings (one per kind, with the record count and the first record) for records whose
    reasoning the template does not render, and those with an end-of-turn marker that is not trained.
    `hits`: reason -> [records, the first one] (`_chat_hit_masks`, over the split)."""
    found = []
    for reason, message in (
        (REASONING_NOT_RENDERED,
         "{n} record(s) of {split} have reasoning the chat template does not render (it is not trained): "
         f"{_reasoning_fix(template)}, or {REASONING_SETTING}: drop to silence this"),
        (EOT_NOT_TRAINED,
         "{n} record(s) of {split} have an assistant turn whose end-of-turn marker is not trained (the chat "
         "template writes no token generation stops on right after the content), so the model is not taught "
         "to stop: "
         f"{suggest_builtin(template)}"),
    ):
        if reason in hits:
            n, first = hits[reason]
            where = Problem(str(pf.path), reason, "", index=first.index, line=first.line, id=first.id,
                            kind=pf.layout).where()
            found.append(Problem(str(pf.path), reason, message.format(n=n, split=split) + f" (first: {where})",
                                 kind=pf.layout))
    return found


# --- CLI ------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline validate", description=__doc__.splitlines()[0])
    p.add_argument("--train", required=True, type=Path)
    p.add_argument("--val", type=Path)
    p.add_argument("--test", type=Path, help="held-out prompts (records with a reference answer)")
    p.add_argument("--tokenizer", required=True, type=Path)  # the run's tokenizer dir (prepare-tokenizer)
    p.add_argument("--max-length", required=True, type=int)
    p.add_argument("--too-long", required=True, choices=TOO_LONG_POLICIES)
    # --duplicates / --reasoning: required, their defaults are the workflow schema's data.* (the rules pass them)
    p.add_argument("--duplicates", required=True, choices=DUPLICATE_POLICIES,
                   help="exact-duplicate conversations within a split: error | warn | drop")
    p.add_argument("--reasoning", required=True, choices=REASONING_POLICIES,
                   help="assistant reasoning: auto / keep train it where the template renders it, drop removes it")
    add_field_arguments(p)
    p.add_argument("--out-json", required=True, type=Path)
    p.add_argument("--out-csv", required=True, type=Path)
    p.add_argument("--failed-report-dir", type=Path,
                   help="on failure, also write validation.json/.csv here (a path the workflow does not delete); "
                        "on success, remove the ones an earlier failure left")
    return p


def main(argv: list[str] | None = None) -> int:
    """Validate, write the reports; raise `DataError` whose last line names the reports that survive."""
    args = _parser().parse_args(argv)
    if args.max_length <= 0:
        raise UserError(f"--max-length must be positive, got {args.max_length}")
    if args.failed_report_dir is not None and _same_files(failed_report_paths(args.failed_report_dir),
                                                          (args.out_json, args.out_csv)):
        # A success clears the failed-report dir: it would delete this run's own reports.
        raise UserError(f"--failed-report-dir {args.failed_report_dir} would hold the --out-json / --out-csv "
                        "files themselves; give it a directory of its own")
    report = validate_dataset(args.train, val=args.val, test=args.test, tokenizer_dir=args.tokenizer,
                              max_length=args.max_length, too_long=args.too_long, duplicates=args.duplicates,
                              reasoning=args.reasoning, fields=field_map(args.columns, args.roles))
    write_report(report, args.out_json, args.out_csv)
    _print_warnings(report)
    if not report.ok:
        kept = (args.out_json, args.out_csv)
        if args.failed_report_dir is not None:
            kept = failed_report_paths(args.failed_report_dir)
            write_report(report, *kept)
        raise DataError(f"{report.summary()}\nfull report: {kept[0]} and {kept[1]}")
    if args.failed_report_dir is not None:
        remove_failed_reports(args.failed_report_dir)  # a stale failure must not be mistaken for this run's
    for name, stats in report.files.items():
        print(_ok_line(name, stats, args))
    return 0


def _same_files(paths: tuple[Path, ...], others: tuple[Path, ...]) -> bool:
    """True if any of `paths` is one of `others` (after resolving)."""
    return bool({p.resolve() for p in paths} & {Path(o).resolve() for o in others})


def _print_warnings(report: ValidationReport) -> None:
    """One stderr line per split with kept duplicates, naming the first (validation.json lists them all),
    and one per chat warning (it holds its own count)."""
    by_split: dict[str, list[Problem]] = {}
    for split, problem in report.warnings:
        if problem.reason == "duplicate_sample":
            by_split.setdefault(split, []).append(problem)
        else:
            print(f"warning: {problem.message}", file=sys.stderr)
    for split, problems in by_split.items():
        print(f"warning: {split}: {len(problems)} duplicate conversation(s) kept (duplicates=warn); "
              f"first: {problems[0].describe()}", file=sys.stderr)


def _ok_line(name: str, stats: dict, args: argparse.Namespace) -> str:
    extra = f", {stats['too_long']} over max_length ({args.too_long})" if stats.get("too_long") else ""
    if stats["duplicates"]:
        extra += f", {stats['duplicates']} duplicate(s) {'dropped' if stats['duplicates_dropped'] else 'kept'}"
    if stats.get("reasoning_records"):
        extra += (f", reasoning in {stats['reasoning_records']} (not trained in {stats['reasoning_dropped']}: "
                  f"{stats['reasoning_dropped_by_policy']} by {REASONING_SETTING}=drop, "
                  f"{stats['reasoning_dropped_by_template']} by the template)")
    if stats.get("eot_not_trained"):
        extra += f", end-of-turn not trained in {stats['eot_not_trained']}"
    kind = describe_kind(stats["kind"])
    return f"{name}: {stats['records']} records ok ({stats['path']}, {kind}){extra}"
