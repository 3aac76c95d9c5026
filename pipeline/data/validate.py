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
``reasoning_dropped_by_policy`` / ``reasoning_dropped_by_template``, and
``placeholders_trained``, ``stop_tokens_inside``, ``markers_in_prompts``), and
five things the user did not ask for are warned about (stderr and ``warnings``, one
entry per split with its record count and first record, and for the last three what
that record holds; the held-out test split is exempt):
reasoning the template does not render (``reasoning_not_rendered``), assistant
turns whose end-of-turn marker is not trained (``eot_not_trained``), trained text
that holds a ``{{name}}`` placeholder left unfilled, outside code
(``placeholders_trained``), a trained reply that holds the text of a token
generation stops on (``stop_tokens_inside``), and a prompt turn that holds the
template's own turn markers, as data rendered with a chat template already does
(``markers_in_prompts``).

Each file is streamed (`pipeline.data.scan`): its records are read and checked
one at a time, a batch at a time, keeping per record its digests, token length
and chat flags (bounded by the record count, never the text), and the problems
found. The checks across records -- repeated ids, duplicates, overlaps with an
earlier split, the stats -- are made of those facts in file order
(`pipeline.data.verdicts`), with the splits in train, val, test order so a
split is checked against the ones before it. A large training file is scanned
by shard jobs (``python -m pipeline validate-shard``, `pipeline.data.shards`)
and their facts merged here (``--scans``): the report is the one a single scan
gives. ``--out-drop`` writes the record indices ``duplicates: drop`` leaves out
of the training cache (found across shards), for the tokenization jobs.

A failed run also writes both reports to ``--failed-report-dir``, which the
workflow keeps out of Snakemake's declared outputs: Snakemake deletes the
outputs of a failed job, and the reports are the evidence of why it failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.data import readers
from pipeline.data.chat import REASONING_POLICIES, REASONING_SETTING
from pipeline.data.formats import DUPLICATE_POLICIES, Problem
from pipeline.data.records import locate
from pipeline.data.kinds import describe_kind
from pipeline.data.scan import Measure, SplitFacts, scan_split
from pipeline.data.shapes import FieldMap, add_arguments as add_field_arguments, fields_of
from pipeline.data.tokenize import TOO_LONG_POLICIES
from pipeline.data.verdicts import merge_split, overlap_notes
from pipeline.data.vision import is_vision_language
from pipeline.errors import DataError, UserError
from pipeline.storage import publish

SPLITS = ("train", "val", "test")
CSV_COLUMNS = ["split", "file", "kind", "index", "line", "part", "part_index", "id", "field", "reason", "message"]
REPORT_NAMES = ("validation.json", "validation.csv")  # the file names inside --failed-report-dir

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
    dropped: dict = field(default_factory=dict)  # split -> record indices duplicates=drop leaves out (not in JSON)
    shards: list = field(default_factory=list)  # the train file's scans: shard, records, seconds (not in JSON)

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
    train_scans: list[str | Path] | None = None,
) -> ValidationReport:
    """Run every check on the given files; never raises for data problems (they go in the report).

    `fields`: the dataset's own key and role names (`pipeline.data.shapes.FieldMap`).
    `train_scans`: the train file's shards, scanned by jobs of their own (`python -m pipeline validate-shard`):
    their facts are merged instead of scanning the file here; the report is the same.
    Raises `UserError` for an unknown policy or a tokenizer that cannot be loaded.
    """
    fields = fields or FieldMap()
    _check_policy("too_long", too_long, TOO_LONG_POLICIES)
    _check_policy("duplicates", duplicates, DUPLICATE_POLICIES)
    paths = {name: p for name, p in zip(SPLITS, (train, val, test)) if p is not None}
    report = ValidationReport(settings={
        "tokenizer": str(tokenizer_dir), "max_length": max_length, "too_long": too_long, "duplicates": duplicates,
        "reasoning": reasoning, "columns": fields.columns, "roles": fields.roles, "image_dir": fields.image_dir,
        **{name: str(p) for name, p in paths.items()},
    })
    image_verdicts: dict[str, tuple[str, str] | None] = {}  # an image shared by many records is read once
    text_only = Path(tokenizer_dir).is_dir() and not is_vision_language(tokenizer_dir)
    measure = Measure(tokenizer_dir, reasoning, image_verdicts)
    scans: dict[str, list[SplitFacts]] = {}
    for name, path in paths.items():
        if name == "train" and train_scans:
            scans[name] = _load_scans(train_scans, path)
        else:
            scans[name] = [scan_split(path, name, fields=fields, measure=measure, image_verdicts=image_verdicts,
                                      text_only=text_only, max_length=max_length, too_long=too_long)]
    report.shards = [{"shard": s.shard, "records": int(s.arrays["index"].size), "seconds": round(s.seconds, 2),
                      "cpu_seconds": round(s.cpu_seconds, 2)} for s in scans.get("train", [])]
    measured = any(s.arrays["index"].size for split in scans.values() for s in split)
    template = next((s.template for split in scans.values() for s in split if s.template), "")
    earlier, verdicts = {}, {}
    for name in paths:  # in SPLITS order: a split is checked against the ones before it
        verdicts[name] = merge_split(scans[name], dict(earlier), duplicates=duplicates, max_length=max_length,
                                     too_long=too_long, last=name == SPLITS[-1], measured=measured, template=template)
        earlier[name] = verdicts[name].index
    for name, verdict in verdicts.items():
        verdict.stats["sha256"] = readers.fingerprint(paths[name]) if verdict.stats["kind"] != "unknown" else ""
        report.warnings += [(name, p) for p in verdict.copies if duplicates == "warn"]
        report.files[name] = verdict.stats
        report.dropped[name] = verdict.dropped
    overlaps = [(name, other, p) for name, v in verdicts.items() for other, p in v.overlaps]
    report.notes += overlap_notes(report.files, overlaps)
    for name, verdict in verdicts.items():
        report.warnings += [(name, w) for w in verdict.warnings]
        if verdict.note:
            report.notes.append(verdict.note)
        report.problems += [(name, p) for p in verdict.problems]
    parts = {name: split[0].parts for name, split in scans.items()}  # every shard finds the same
    report.problems = [(name, locate(p, parts[name])) for name, p in report.problems]
    report.warnings = [(name, locate(p, parts[name])) for name, p in report.warnings]
    return report


def _load_scans(paths: list[str | Path], source: str | Path) -> list[SplitFacts]:
    """The shards' facts; a `UserError` if they are not every shard of `source`, once each."""
    facts = [SplitFacts.load(p) for p in paths]
    shards = sorted(f.shard for f in facts)
    if shards != list(range(facts[0].shards)) or any(f.shards != facts[0].shards for f in facts):
        raise UserError(f"--scans: shards {shards} of {facts[0].shards} given; every shard of {source} once is needed")
    if any(Path(f.path).resolve() != Path(source).resolve() for f in facts):
        raise UserError(f"--scans: scans of {sorted({f.path for f in facts})}, not of {source}")
    return facts


def write_report(report: ValidationReport, out_json: str | Path, out_csv: str | Path) -> None:
    """Write both reports (also on failure: they are how the user finds every problem).

    Each file is written to a temporary name and renamed into place, so a
    reader never sees half a report, and a crash never leaves one.
    """
    import pandas as pd

    publish.write_text(out_json, json.dumps(report.to_json(), indent=2, ensure_ascii=False) + "\n")
    rows = [{"split": split, **p.to_dict()} for split, p in report.problems]
    frame = pd.DataFrame(rows, columns=CSV_COLUMNS)
    for column in ("index", "line", "part_index"):
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
    p.add_argument("--scans", nargs="+", type=Path,
                   help="the train file's shard scans (validate-shard --out): merged instead of reading the file here")
    p.add_argument("--out-json", required=True, type=Path)
    p.add_argument("--out-csv", required=True, type=Path)
    p.add_argument("--out-drop", type=Path, help="the train records duplicates=drop leaves out (.npy, int64 indices)")
    p.add_argument("--shards-out", type=Path, help="each train shard's records and time (JSON; one shard: the scan)")
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
                              reasoning=args.reasoning, fields=fields_of(args),
                              train_scans=args.scans)
    write_report(report, args.out_json, args.out_csv)
    if args.out_drop is not None:
        with publish.staged_file(args.out_drop) as tmp, open(tmp, "wb") as f:
            np.save(f, report.dropped.get("train", np.zeros(0, dtype=np.int64)))
    if args.shards_out is not None:
        publish.write_text(args.shards_out, json.dumps({"shards": report.shards}, indent=2) + "\n")
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
    if stats.get("placeholders_trained"):
        extra += f", unfilled placeholders trained in {stats['placeholders_trained']}"
    if stats.get("stop_tokens_inside"):
        extra += f", stop tokens inside replies in {stats['stop_tokens_inside']}"
    if stats.get("markers_in_prompts"):
        extra += f", turn markers in prompts in {stats['markers_in_prompts']}"
    kind = describe_kind(stats["kind"])
    return f"{name}: {stats['records']} records ok ({stats['path']}, {kind}){extra}"
