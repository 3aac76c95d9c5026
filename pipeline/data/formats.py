"""Reading chat datasets: every file kind and record shape, normalized to one `Record`.

Which files (`pipeline.data.kinds`, read by `pipeline.data.readers`): JSON
arrays, JSON Lines, CSV / TSV, Parquet, Arrow (IPC files, or a ``datasets``
``save_to_disk`` directory), the text kinds also compressed; chosen by the name
and confirmed by the content, and named in every problem. Any other kind is one
problem naming it and the kinds accepted.
Which records (`pipeline.data.shapes`, normalized by `pipeline.data.normalize`):
OpenAI ``messages``, ShareGPT/LLaVA ``conversations``, TRL ``prompt`` /
``completion`` (strings or message lists), Alpaca ``instruction`` / ``input`` /
``output`` and plain ``text``, each with optional ``id``, ``system`` and
``image`` / ``images``; a `FieldMap` (``data.columns`` / ``data.roles``) maps a
dataset's own key and role names onto these. A CSV cell that holds JSON (a
``messages`` column) is parsed (`pipeline.data.cells`). A file in which no
record has a shape gets one problem naming the keys it has.

`parse_file` never raises on bad content: it returns the well-formed records
and a `Problem` for every fault it finds, so validation can report all of them
at once (`ParsedFile.rejected` keeps the images of a rejected record, so a
missing image file is reported too). `load_records` is the strict front door
for the stages that only want clean data. `stream_file` reads one record at a
time; given a shard's `owns`, only that shard's records (`pipeline.data.shards`),
leaving the file-level problems to `file_problems` over every shard's `FileState`.

Exact duplicates (same messages and images) are found by `duplicate_of`; what
happens to them is the user's ``duplicates`` policy (`DUPLICATE_POLICIES`),
applied by validation and, for ``drop``, by tokenization (`drop_duplicates`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.data import readers
from pipeline.data.cells import decode_cells
from pipeline.data.kinds import KindError, base_kind
from pipeline.data.normalize import KEYS_SHOWN, normalize_record
from pipeline.data.readers import SKIPPED, Unreadable
from pipeline.data.records import (DUPLICATE_POLICIES, IMAGE_PLACEHOLDER, TEXT_ROLE, ParsedFile, Problem, Record,
                                   conversation_key, drop_duplicates, duplicate_of, format_problems,
                                   prompt_and_reference)
from pipeline.data.shapes import ROLE_ALIASES, FieldMap, accepted_text, detect
from pipeline.errors import DataError
from pipeline.storage.globs import is_glob

__all__ = [  # re-exported: callers read records, problems and the policies from here
    "DUPLICATE_POLICIES", "IMAGE_PLACEHOLDER", "ROLE_ALIASES", "TEXT_ROLE", "FieldMap", "ParsedFile", "Problem",
    "Record", "conversation_key", "drop_duplicates", "duplicate_of", "format_problems", "prompt_and_reference",
]


@dataclass
class FileState:
    """What reading a file (or one shard of it) found beyond its records' own problems: the file-level facts
    that `file_problems` turns into problems, over every shard. JSON-able (`to_dict` / `from_dict`)."""

    records_seen: int = 0  # records in the file, rejected ones included (a shard counts every shard's)
    shaped: int = 0  # records read that have a shape (of this shard)
    unknown: int = 0  # records read that have none (their missing_turns problems are among the record problems)
    keys: dict = field(default_factory=dict)  # key of a record of no shape -> [record index, position]: first seen
    text: int = 0  # plain text records, and conversations: a file holds one kind
    chat: int = 0
    first_text: int | None = None
    first_chat: int | None = None
    faults: list = field(default_factory=list)  # (reason, message, line) of the file itself

    def see(self, record: Record) -> None:
        if record.is_text:
            self.text += 1
            self.first_text = record.index if self.first_text is None else self.first_text
        else:
            self.chat += 1
            self.first_chat = record.index if self.first_chat is None else self.first_chat

    def to_dict(self) -> dict:
        return {**self.__dict__, "faults": [list(f) for f in self.faults]}

    @classmethod
    def from_dict(cls, data: dict) -> FileState:
        return cls(**{**data, "faults": [tuple(f) for f in data["faults"]]})


def parse_file(path: str | Path, fields: FieldMap | None = None) -> ParsedFile:
    """Read and normalize every record of `path`, collecting (not raising) problems.

    A missing or unreadable path, or one that is no dataset kind, is itself a
    problem (reason ``file_not_found``, ``unsupported_kind``, ...). `fields`: the
    user's key and role names (`FieldMap`; none by default). All records in
    memory: `stream_file` is the same reading one record at a time.
    """
    parsed, records = stream_file(path, fields)
    parsed.records = list(records)
    return parsed


def stream_file(path: str | Path, fields: FieldMap | None = None, *, owns: Callable[[int], bool] | None = None,
                fingerprint: bool = True, finish: bool = True) -> tuple[ParsedFile, Iterator[Record]]:
    """(`ParsedFile` without its records, the records one at a time): `parse_file` in bounded memory.

    The ParsedFile's `problems` and `records_seen` are complete once the
    iterator is exhausted (file-level faults such as a missing file are there
    at once, and the iterator is then empty). With `owns` (one shard of the
    file) only the records it owns are read. ``finish=False`` leaves the file-level
    problems out, and ``ParsedFile.state`` for `file_problems`, which makes them of
    every shard's state at once.
    `fingerprint`: the file's sha256 in ``ParsedFile.sha256`` (a shard leaves it to the merge).
    """
    path = Path(path)
    fields = fields or FieldMap()
    name = readers.display_name(path)  # a hub pin: its URL
    parsed = ParsedFile(path, "unknown", "", name=name)
    if not path.exists() and not is_glob(path):
        parsed.problems.append(Problem(name, "file_not_found", "no such file or directory"))
        return parsed, iter(())
    try:
        kind = readers.sniff(path)
    except KindError as err:
        parsed.problems.append(Problem(name, err.reason, str(err)))
        return parsed, iter(())
    parsed.layout = kind
    parsed.sha256 = readers.fingerprint(path) if fingerprint else ""
    unshaped = _unshaped_columns(path, kind, fields)
    if unshaped is not None:
        parsed.problems.append(Problem(name, "unknown_shape", unshaped, kind=kind))
        return parsed, iter(())
    return parsed, _scan(parsed, kind, fields, owns, finish)


def _scan(parsed: ParsedFile, kind: str, fields: FieldMap, owns, finish: bool) -> Iterator[Record]:
    """The clean records of `parsed.path` (those `owns` keeps); its problems and counts go to `parsed` on the way."""
    path, name = parsed.path, parsed.name
    base_dir = fields.image_dir or readers.base_dir(path)
    state = parsed.state = FileState()
    cells = base_kind(kind) in ("csv", "tsv")
    for index, (line, raw) in enumerate(readers.read_raw(path, kind, state.faults, owns, parsed.parts)):
        parsed.records_seen += 1
        if raw is SKIPPED:
            continue
        if isinstance(raw, Unreadable):
            parsed.problems.append(Problem(name, raw.reason, raw.message, index=index, line=line, kind=kind))
            continue
        if cells:
            raw, cell_problems = decode_cells(raw, fields)
            if cell_problems:  # a record that could not be decoded, as a JSON Lines line that is no JSON
                state.shaped += 1
                parsed.problems += [Problem(name, reason, message, index=index, line=line, field=column, kind=kind)
                                    for reason, message, column in cell_problems]
                continue
        record, problems = normalize_record(raw, index=index, line=line, file=name, kind=kind, base_dir=base_dir,
                                            fields=fields)
        if any(p.reason == "missing_turns" for p in problems):
            state.unknown += 1
            for position, key in enumerate(raw):
                state.keys.setdefault(key, [index, position])
        elif isinstance(raw, dict):
            state.shaped += 1
        parsed.problems.extend(problems)
        if record is None:
            continue
        state.see(record)
        if not problems:
            yield record
        elif record.images:  # kept so validation also reports its missing images (a record reports every defect)
            parsed.rejected.append(record)
    state.records_seen = parsed.records_seen
    if finish:
        parsed.problems = file_problems(name, kind, [state], parsed.problems)


def file_problems(name: str, kind: str, states: list[FileState], problems: list[Problem]) -> list[Problem]:
    """`problems` (the records' own, every shard's, in file order) with the file-level ones of the shards' states:
    a file holding text and conversations, the faults of the file, and, when no record has a shape, one problem
    naming the keys in place of one per record."""
    text, chat = sum(s.text for s in states), sum(s.chat for s in states)
    out = list(problems)
    if text and chat:
        first_text = min(s.first_text for s in states if s.first_text is not None)
        first_chat = min(s.first_chat for s in states if s.first_chat is not None)
        out.append(Problem(name, "mixed_shapes", f"{text} plain text record(s) (first: record {first_text}) and "
                           f"{chat} conversation(s) (first: record {first_chat}) in one file: a file holds one kind; "
                           "put the text records in a file of their own (a data mix can combine them)", kind=kind))
    faults = states[0].faults  # every shard reads the whole file, and so meets the same faults
    out += [Problem(name, reason, message, line=line, kind=kind) for reason, message, line in faults]
    if any(s.unknown for s in states) and not any(s.shaped for s in states):
        firsts: dict[str, tuple] = {}
        for s in states:
            for key, at in s.keys.items():
                firsts[key] = min(firsts.get(key, tuple(at)), tuple(at))
        keys = sorted(firsts, key=firsts.get)
        out = [p for p in out if p.reason != "missing_turns"]
        out.append(Problem(name, "unknown_shape", _unknown_shape_text(keys), kind=kind))
    if not states[0].records_seen and not out:
        out.append(Problem(name, "no_records", "the file holds no records", kind=kind))
    return out


def _unshaped_columns(path: Path, kind: str, fields: FieldMap) -> str | None:
    """For a table (Parquet, Arrow, CSV), the one-line problem when its columns make no shape (no row read)."""
    names = readers.columns(path, kind)
    if names is None or detect(fields.view(dict.fromkeys(names))) is not None:
        return None
    return _unknown_shape_text(names, "columns")


def _unknown_shape_text(keys: list[str], what: str = "keys") -> str:
    shown = ", ".join(repr(k) for k in keys[:KEYS_SHOWN]) + (" ..." if len(keys) > KEYS_SHOWN else "")
    # TRL's and LLaMA-Factory v1's preference data: chosen / rejected (or chosen_messages / rejected_messages)
    paired = any(k.startswith("chosen") for k in keys) and any(k.startswith("rejected") for k in keys)
    return (f"no record has a shape this pipeline reads: the {what} are {shown or 'none'}; "
            + ("this is preference data (chosen / rejected, for DPO), and SFT trains one answer: write the prompt "
               "and the chosen answer as a conversation; " if paired else "")
            + f"accepted: {accepted_text()}; if your keys are named otherwise, map them with data.columns "
            "(e.g. {prompt: question, completion: answer})")


def load_records(path: str | Path, fields: FieldMap | None = None) -> list[Record]:
    """All records of `path`, normalized; raises `DataError` listing the problems if any."""
    parsed = parse_file(path, fields)
    if parsed.problems:
        raise DataError(format_problems(parsed.problems, header=f"{readers.display_name(path)} is not a valid dataset"))
    return parsed.records
