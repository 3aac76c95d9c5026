"""The checks of one record at a time, over a split or one shard of it: facts for `pipeline.data.verdicts`.

A scan streams a dataset file (`formats.stream_file`; a shard: only the
records it owns) and keeps, per record, what the checks that look at one
record find -- its structure's problems, its images' (`pipeline.data.images`),
a split's own rule (no plain text in test), its token length under the chat
template and whether the template fails on it or it is over ``max_length`` --
and what the checks across records need, as 16-byte digests: its id, its
sample (messages and images), its conversation compared loosely across splits.

Nothing here compares two records: which record repeats which, and which
overlaps another split, is decided by `pipeline.data.verdicts` over every
shard's facts in file order, so N shards give exactly the report one scan
does. A scan of every record is a shard of one. `SplitFacts.save` / `load`
keep a shard's facts between its job and the merge's (a ``.npz`` of the
arrays and a ``.json`` of the rest): their size grows with the records as
digests and lengths (~60 bytes a record) and with the problems found.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.data.formats import FileState, ParsedFile, Problem, Record, stream_file
from pipeline.data.images import check_image
from pipeline.data.shapes import FieldMap, fields_of
from pipeline.data.shards import owns, parse_shard
from pipeline.data.stream import DIGEST_BYTES, batched, digest, loose_digest, sample_digest

SCAN_BATCH = 2048  # records checked at a time (the tokenizer's batch)
_DIGEST = f"S{DIGEST_BYTES}"
# Per-record arrays of a scan, and their dtypes.
_ARRAYS = {"index": np.int64, "line": np.int64, "has_id": bool, "id_digest": _DIGEST, "sample": _DIGEST,
           "loose": _DIGEST, "images": np.int64, "length": np.int64, "flags": bool}
CHAT_FLAG_COUNT = 7  # `tokenize.CHAT_COUNTS`


@dataclass
class SplitFacts:
    """One split's (or shard's) scan: per clean record (file order) its place, digests, image count, token length
    (-1: not measured) and chat flags; the problems of single records, by the check that found them."""

    split: str
    path: str
    kind: str
    shard: int = 0  # shard `shard` of `shards` (`pipeline.data.shards`)
    shards: int = 1
    records_seen: int = 0
    state: dict = field(default_factory=dict)  # `formats.FileState` as a dict (file-level facts)
    ids: list = field(default_factory=list)  # per record: its id or None
    image_paths: dict = field(default_factory=dict)  # record index -> its image paths (records with images)
    parse: list = field(default_factory=list)  # problems of structure (records rejected while reading)
    checks: list = field(default_factory=list)  # image and split problems (rejected records' images too)
    measured: list = field(default_factory=list)  # template failures; over max_length under too_long=error
    arrays: dict = field(default_factory=dict)
    template: str = ""  # the chat template the records were measured with ("" when none was)
    parts: list = field(default_factory=list)  # a dataset of several files: [first record, file] each
    # per `tokenize.FOUND` count: {index: what it holds} of its first record, which a warning names (a record
    # dropped as a duplicate never is the first: its earlier copy holds the same)
    examples: dict = field(default_factory=dict)
    seconds: float = 0.0
    cpu_seconds: float = 0.0

    def save(self, path: str | Path) -> None:
        """`path` (.json) and its .npz beside it, each written whole or not at all."""
        from pipeline.storage import publish

        path = Path(path)
        meta = {k: v for k, v in self.__dict__.items() if k != "arrays"}
        for key in ("parse", "checks", "measured"):
            meta[key] = [p.to_dict() for p in meta[key]]
        meta["image_paths"] = {str(k): v for k, v in self.image_paths.items()}
        with publish.staged_file(path.with_suffix(".npz")) as tmp, open(tmp, "wb") as f:
            np.savez(f, **self.arrays)
        publish.write_text(path, json.dumps(meta) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> SplitFacts:
        path = Path(path)
        meta = json.loads(path.read_text())
        for key in ("parse", "checks", "measured"):
            meta[key] = [Problem(**p) for p in meta[key]]
        meta["image_paths"] = {int(k): v for k, v in meta["image_paths"].items()}
        meta["examples"] = {k: {int(i): what for i, what in v.items()} for k, v in meta.get("examples", {}).items()}
        with np.load(path.with_suffix(".npz")) as arrays:
            meta["arrays"] = {k: arrays[k] for k in arrays.files}
        flags = meta["arrays"]["flags"]  # a scan by an older version has fewer flags: the later checks found nothing
        meta["arrays"]["flags"] = np.pad(flags, ((0, 0), (0, CHAT_FLAG_COUNT - flags.shape[1])))
        return cls(**meta)


def scan_split(path: str | Path, split: str, *, fields: FieldMap, measure, image_verdicts: dict, text_only: bool,
               max_length: int, too_long: str, shard: tuple[int, int] = (0, 1)) -> SplitFacts:
    """Scan `path` as split `split` (`shard`: shard k of n, `pipeline.data.shards`). `measure`: records ->
    (lengths, {position: error}, flags, {position: findings}) (`Measure`); `image_verdicts`: image path ->
    problem or None, filled as images are read."""
    start, cpu = time.perf_counter(), time.process_time()
    pf, stream = stream_file(path, fields, owns=owns(*shard), fingerprint=False, finish=False)
    facts = SplitFacts(split, str(pf.path), pf.layout, *shard)
    parts: dict[str, list] = {name: [] for name in _ARRAYS}
    for batch in batched(stream, SCAN_BATCH):
        _scan_batch(facts, parts, pf, batch, measure, image_verdicts, text_only, max_length, too_long)
    if pf.rejected:  # records rejected after the last clean one: their images are still checked
        _scan_batch(facts, parts, pf, [], measure, image_verdicts, text_only, max_length, too_long)
    facts.records_seen = pf.records_seen
    facts.state = (pf.state or FileState()).to_dict()
    facts.parse = list(pf.problems)
    facts.parts = pf.parts
    facts.template = measure.template
    facts.arrays = {name: (np.concatenate(chunks) if chunks else _empty(name)) for name, chunks in parts.items()}
    facts.seconds, facts.cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    return facts


def _empty(name: str) -> np.ndarray:
    shape = (0, CHAT_FLAG_COUNT) if name == "flags" else (0,)
    return np.zeros(shape, dtype=_ARRAYS[name])


def _scan_batch(facts: SplitFacts, parts: dict, pf: ParsedFile, batch: list[Record], measure, image_verdicts: dict,
                text_only: bool, max_length: int, too_long: str) -> None:
    """One batch of clean records, and the image checks of the records rejected since the last batch."""
    rejected, pf.rejected[:] = list(pf.rejected), []
    facts.checks += _image_problems(pf, batch, rejected, image_verdicts, text_only)
    facts.checks += _split_record_problems(pf, batch, facts.split)
    for r in batch:
        facts.ids.append(r.id)
        if r.images:
            facts.image_paths[r.index] = list(r.images)
    parts["index"].append(np.array([r.index for r in batch], dtype=np.int64))
    parts["line"].append(np.array([-1 if r.line is None else r.line for r in batch], dtype=np.int64))
    parts["has_id"].append(np.array([r.id is not None for r in batch], dtype=bool))
    parts["id_digest"].append(np.array([digest(r.id) if r.id is not None else b"" for r in batch], dtype=_DIGEST))
    parts["sample"].append(np.array([sample_digest(r) for r in batch], dtype=_DIGEST))
    parts["loose"].append(np.array([loose_digest(r) for r in batch], dtype=_DIGEST))
    parts["images"].append(np.array([len(r.images) for r in batch], dtype=np.int64))
    if not batch:
        return
    lengths, errors, flags, found = measure(batch)
    for i, findings in sorted(found.items()):
        for name, what in findings.items():
            facts.examples.setdefault(name, {batch[i].index: what})
    parts["length"].append(lengths)
    parts["flags"].append(flags)
    facts.measured += [_problem(pf, batch[i], "template_error", msg) for i, msg in errors.items()]
    if too_long == "error":
        facts.measured += [_problem(pf, batch[i], "too_long", f"{lengths[i]} tokens > max_length {max_length}")
                           for i in np.flatnonzero(lengths > max_length)]


def _problem(pf: ParsedFile, record: Record, reason: str, message: str, field_: str | None = None) -> Problem:
    """A problem about `record` of `pf` (clean or rejected)."""
    return Problem(pf.name, reason, message, index=record.index, line=record.line, id=record.id, field=field_,
                   kind=pf.layout)


def _image_problems(pf: ParsedFile, batch: list[Record], rejected: list[Record], verdicts: dict,
                    text_only: bool) -> list[Problem]:
    """Every unreadable image of every record, those already rejected for another defect included
    (a record reports all its defects at once); with `text_only`, one problem per record with images."""
    problems = []
    for record in sorted(batch + rejected, key=lambda r: r.index):
        if text_only and record.images:
            problems.append(_problem(
                pf, record, "images_on_text_model", f"{len(record.images)} image(s) given to a text-only model (its "
                "tokenizer dir has no image processor): images need a vision-language model; remove them, or "
                "train a vision-language model", "image"))
        for j, image in enumerate(record.images):
            if image not in verdicts:
                verdicts[image] = check_image(image)
            if verdicts[image] is not None:
                reason, message = verdicts[image]
                problems.append(_problem(pf, record, reason, message, f"image[{j}]"))
    return problems


def _split_record_problems(pf: ParsedFile, batch: list[Record], split: str) -> list[Problem]:
    """Records a split cannot use: a test record needs a prompt and a reference answer, which plain text has not."""
    if split != "test":
        return []
    return [_problem(pf, r, "text_in_test", "a plain text record has no prompt and reference answer to "
                     "score: the test split holds conversations (data.test: null skips it)", "text")
            for r in batch if r.is_text]


class Measure:
    """Token lengths, chat flags and findings of a batch, as tokenization will count them (`tokenize.sequence_lengths`); the
    tokenizer is loaded at the first batch that has records, so a dataset with none never loads it.

    A vision-language model's records are measured with their image tokens
    expanded, except where an image is unusable (already a problem): -1 there.
    """

    def __init__(self, tokenizer_dir, reasoning: str, image_verdicts: dict):
        self.tokenizer_dir, self.reasoning, self.image_verdicts = tokenizer_dir, reasoning, image_verdicts
        self.loaded = False
        self.template = ""

    def __call__(self, records: list[Record]) -> tuple[np.ndarray, dict[int, str], np.ndarray, dict[int, dict]]:
        from pipeline.data.tokenize import load_chat, sequence_lengths  # imports transformers: only when needed

        if not self.loaded:
            self.tokenizer, self.images = load_chat(self.tokenizer_dir)
            self.template = (self.images.chat_template if self.images else self.tokenizer.chat_template) or ""
            self.loaded = True
        usable = [i for i, r in enumerate(records) if self.images is None
                  or all(self.image_verdicts.get(p) is None for p in r.images)]
        found: dict[int, dict] = {}
        measured, errors, measured_flags = sequence_lengths(self.tokenizer, [records[i] for i in usable],
                                                            self.images, reasoning=self.reasoning, found=found)
        lengths = np.full(len(records), -1, dtype=np.int64)
        lengths[usable] = measured
        flags = np.zeros((len(records), CHAT_FLAG_COUNT), dtype=bool)
        flags[usable] = measured_flags
        return (lengths, {usable[i]: msg for i, msg in errors.items()}, flags,
                {usable[i]: findings for i, findings in found.items()})


def add_job_arguments(parser, *, duplicates: bool) -> None:
    """The options of a shard job (``validate-shard``, ``tokenize-shard``): the file, which shard, the run's
    tokenizer and the data settings (`pipeline.data.datasets.RunData.flags` passes them)."""
    from pipeline.data.chat import REASONING_POLICIES
    from pipeline.data.formats import DUPLICATE_POLICIES
    from pipeline.data.shapes import add_arguments as add_field_arguments
    from pipeline.data.tokenize import TOO_LONG_POLICIES  # transformers only when a job starts

    parser.add_argument("--train", required=True, type=Path)
    parser.add_argument("--shard", required=True, type=parse_shard, metavar="K/N", help="shard K of N, from 0")
    parser.add_argument("--tokenizer", required=True, type=Path)
    parser.add_argument("--max-length", required=True, type=int)
    parser.add_argument("--too-long", required=True, choices=TOO_LONG_POLICIES)
    parser.add_argument("--reasoning", required=True, choices=REASONING_POLICIES)
    if duplicates:
        parser.add_argument("--duplicates", required=True, choices=DUPLICATE_POLICIES)
    add_field_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    """`python -m pipeline validate-shard`: scan one shard of a training file, write its facts for `validate --scans`."""
    from pipeline.data.vision import is_vision_language

    p = argparse.ArgumentParser(prog="python -m pipeline validate-shard", description=main.__doc__.split(":")[1])
    add_job_arguments(p, duplicates=False)
    p.add_argument("--out", required=True, type=Path, help="the facts: OUT (.json) and OUT's .npz beside it")
    args = p.parse_args(argv)
    verdicts: dict = {}
    text_only = args.tokenizer.is_dir() and not is_vision_language(args.tokenizer)
    facts = scan_split(args.train, "train", fields=fields_of(args),
                       measure=Measure(args.tokenizer, args.reasoning, verdicts), image_verdicts=verdicts,
                       text_only=text_only, max_length=args.max_length, too_long=args.too_long, shard=args.shard)
    facts.save(args.out)
    k, n = args.shard
    print(f"train shard {k}/{n}: {facts.arrays['index'].size} of {facts.records_seen} records scanned "
          f"({len(facts.parse) + len(facts.checks) + len(facts.measured)} problem(s) of single records) in "
          f"{facts.seconds:.1f} s ({facts.cpu_seconds:.1f} s CPU) -> {args.out}")
    return 0
