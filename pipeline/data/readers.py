"""Dataset files: their raw records, streamed, of every kind `pipeline.data.kinds` names.

* ``json``: one JSON array of records. Parsed whole: JSON has no record boundary
  to stream on, so large datasets belong in JSON Lines, CSV or Parquet.
* ``jsonl``: one JSON value per non-blank line (blank: only JSON whitespace), read line by line.
* ``csv`` / ``tsv``: a header row naming the columns, then one record per row
  (a quoted cell may span lines); an empty cell is left out of its record, as
  a null Parquet cell is. Cells are strings: `pipeline.data.cells` parses the
  ones that hold JSON (a ``messages`` column).
* ``parquet`` / ``arrow``: `pipeline.data.columnar`.

A pin of dataset files from the Hugging Face hub (`pipeline.storage.hub_data`: a
``.hub.json`` written by ``fetch-data``) is read as one dataset: its files, in the
pin's (sorted) order, one after another, records numbered on across them; they
must be of one kind, and messages name the dataset by its hub URL (`display_name`). A
directory of data files (`kinds.shard_files`: what `hf download` leaves, a partitioned
write) is read the same way, its files in the order of their paths in it, and so are the
files a glob matches (`kinds.glob_files`: ``data/train-*.parquet``).

A compressed text kind (``jsonl.gz``, ...) is decompressed as it streams. Every
record keeps its place in the file: `read_raw` numbers records from 0 and
JSON Lines / CSV records carry their 1-based line.

`read_raw` never raises on bad content: faults of the file go to the caller's
problem list as ``(reason, message, line)``; a record that cannot be decoded
is yielded as an `Unreadable` (the numbering stays the file's); the records
that can be read still come. `owns` (a shard's records, `pipeline.data.shards`)
yields `SKIPPED` in place of every other record, found and counted but not decoded.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline.data import columnar
from pipeline.data import kinds
from pipeline.data.kinds import BOM, KindError, base_kind, describe_kind, is_columnar, open_binary
from pipeline.storage import globs, hub_data

__all__ = ["KindError", "describe_kind"]  # re-exported: the kind of a path is asked here

EMPTY = ("empty_file", "the file is empty (or only whitespace)", None)
SKIPPED = object()  # yielded for a record another shard owns
_JSON_BLANK = b" \t\r\n"
_DELIMITERS = {"csv": ",", "tsv": "\t"}
csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # a cell holding a whole conversation can be long


@dataclass(frozen=True)
class Unreadable:
    """Yielded in place of a record that could not be decoded: a record that failed, and why."""

    reason: str
    message: str


def sniff(path: Path) -> str:
    """The kind of the dataset at `path` (`kinds.sniff`); a hub pin's: that of its files, which must share one."""
    files = hub_data.pinned_files(path)
    if files is None:
        return kinds.sniff(Path(path))
    for f in files:
        if not f.is_file():
            raise KindError("file_not_found", f"{f} is no longer in the Hugging Face cache: delete {path} and run "
                            "the workflow again to fetch it")
    return kinds.sniff_files(files, [f.name for f in files])


def dataset_files(path: str | Path) -> tuple[list[Path], list[str]] | None:
    """The files of a dataset held in several (a hub pin's; a directory of data files, `kinds.shard_files`; a
    glob's matches, `kinds.glob_files`) and how messages name each (its path in the repo, in the directory, or
    below the glob's fixed directories); None for one file or a save_to_disk directory. `KindError` for a
    directory (or glob) of several splits' files."""
    pinned = hub_data.pinned_files(path)
    if pinned is not None:
        revision = hub_data.read_pin(path)["revision"]
        return pinned, [hub_data.repo_path(f, revision) for f in pinned]
    matched = kinds.glob_files(path)
    if matched is not None:
        root = globs.root(path)
        return (matched, [f.relative_to(root).as_posix() for f in matched]) if matched else None
    path = Path(path)
    files = kinds.shard_files(path) if path.is_dir() else None
    return (files, [f.relative_to(path).as_posix() for f in files]) if files else None


def base_dir(path: str | Path) -> str:
    """The directory a dataset's relative image paths start from: the file's own; for a dataset of several files,
    the directory of its first (a hub pin's: in the cache snapshot, the repo's folder the records were written
    beside)."""
    several = dataset_files(path)
    return os.path.dirname(os.path.abspath(several[0][0] if several else path))


def display_name(path: str | Path) -> str:
    """How messages name the dataset at `path`: a hub pin by its URL, anything else by its path."""
    return hub_data.read_pin(path)["url"] if hub_data.is_pin(path) else str(path)


def fingerprint(path: str | Path) -> str:
    """sha256 of a file's bytes, read in chunks; of a directory (or a hub pin's files, a glob's), over its files'
    names and bytes in order."""
    path = Path(path)
    digest = hashlib.sha256()
    pinned = hub_data.pinned_files(path)
    several = None if pinned else dataset_files(path)
    files = pinned or (several[0] if several else None) or (
        sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path])
    names = several[1] if several else None
    for i, p in enumerate(files):
        if pinned:
            digest.update(p.name.encode() + b"\0")
        elif names is not None:
            digest.update(names[i].encode() + b"\0")
        elif path.is_dir():
            digest.update(str(p.relative_to(path)).encode() + b"\0")
        with open(p, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def columns(path: Path, kind: str) -> list[str] | None:
    """The column names of a Parquet / Arrow / CSV / TSV dataset (its schema or header row, no record read); None
    for JSON kinds and for columns that cannot be read (`read_raw` then reports why). A hub pin: its first file's."""
    several = dataset_files(path)
    if several:
        path = several[0][0]
    if is_columnar(kind):
        return columnar.columns(path, kind)
    if base_kind(kind) not in _DELIMITERS:
        return None
    with open_binary(path, kind) as f:
        try:
            header = next(csv.reader(_Lines(f), delimiter=_DELIMITERS[base_kind(kind)]), None)
        except (csv.Error, OSError, EOFError):
            return None
    return [name for name in header if name] if header else None


def read_raw(path: Path, kind: str, problems: list, owns: Callable[[int], bool] | None = None,
             parts: list | None = None) -> Iterator[tuple[int | None, object]]:
    """(line or None, raw record, `Unreadable` or `SKIPPED`) for every record of `path`, in file order.

    A fault of the file appends ``(reason, message, line or None)`` to
    `problems`. A Parquet / Arrow fault mid-file, or a compressed stream that
    breaks off, ends the reading there. A hub pin: its files, one after another (`_read_files`); a line is
    within its own file, and `parts` gets ``[first record's number, the file's path in the repo]`` per file
    of a pin of several (`pipeline.data.records.locate` names a record's file with them).
    """
    several = dataset_files(path)
    if several is not None:
        files, names = several
        yield from _read_files(files, names, kind, problems, owns, parts if len(files) > 1 else None)
        return
    if is_columnar(kind):
        yield from columnar.read_columnar(path, kind, problems, owns, SKIPPED)
        return
    reader = {"json": _read_json_array, "jsonl": _read_jsonl}.get(base_kind(kind), _read_delimited)
    try:
        with open_binary(path, kind) as f:
            yield from reader(f, kind, problems, owns)
    except kinds.stream_errors() as err:  # a corrupt or truncated compressed stream
        problems.append((f"invalid_{kind.partition('.')[2] or kind}", f"cannot read the {describe_kind(kind)} "
                         f"data to its end: {err}", None))


def _read_files(files: list[Path], names: list[str], kind: str, problems: list, owns: Callable[[int], bool] | None,
                parts: list | None) -> Iterator[tuple[int | None, object]]:
    """Several files of one kind read as one dataset: records numbered on from file to file (`owns` is asked
    about that number); a fault of a file names it (`names`)."""
    before = 0  # records of the files already read
    for f, name in zip(files, names):
        if parts is not None:
            parts.append([before, name])
        own = None if owns is None else (lambda i, base=before: owns(base + i))
        found: list = []
        for item in read_raw(f, kind, found, own):
            before += 1
            yield item
        problems += [(reason, f"{name}: {message}", line) for reason, message, line in found]


# --- JSON and JSON Lines --------------------------------------------------------------------------


def _read_json_array(f, kind: str, problems: list, owns) -> Iterator[tuple[None, object]]:
    text = _decode_whole(f.read().removeprefix(BOM), problems)
    if text is None:
        return
    if not text.strip():
        problems.append(EMPTY)
        return
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        message = _extra_data_message(text, err) if err.msg == "Extra data" else _decode_error_text(err, err.lineno)
        problems.append(("invalid_json", message, err.lineno))
        return
    if not isinstance(doc, list):
        problems.append(("wrong_top_level_type", f"expected a JSON array of records, found a JSON {json_type(doc)}"
                         + _object_hint(doc), None))
        return
    for i, raw in enumerate(doc):
        yield None, (raw if owns is None or owns(i) else SKIPPED)


def _read_jsonl(f, kind: str, problems: list, owns) -> Iterator[tuple[int, object]]:
    """One record per non-blank line; a bad line is a record that failed, the others still count."""
    index = 0
    for lineno, raw_line in enumerate(f, start=1):
        if lineno == 1:
            raw_line = raw_line.removeprefix(BOM)
        raw_line = raw_line.rstrip(b"\r\n")
        if not raw_line.strip(_JSON_BLANK):
            continue
        index += 1
        if owns is not None and not owns(index - 1):
            yield lineno, SKIPPED
            continue
        try:
            text = raw_line.decode("utf-8")
        except UnicodeDecodeError as err:
            yield lineno, _bad_utf8(raw_line, err, lineno)
            continue
        try:
            yield lineno, json.loads(text)
        except json.JSONDecodeError as err:
            yield lineno, Unreadable("invalid_json", _decode_error_text(err, lineno))
    if not index:
        problems.append(EMPTY)


def _bad_utf8(raw_line: bytes, err: UnicodeDecodeError, lineno: int) -> Unreadable:
    col = len(raw_line[:err.start].decode("utf-8", errors="replace")) + 1
    return Unreadable("invalid_utf8", f"invalid UTF-8 byte 0x{raw_line[err.start]:02x} at line {lineno} column {col}")


def _decode_error_text(err: json.JSONDecodeError, line: int) -> str:
    """json's reason plus where, e.g. 'Unterminated string starting at line 2 column 9'.

    Some of json's reasons already end in " at" ("Unterminated string starting
    at", "Invalid control character at"): appending " at line ..." would say
    "at at", so that trailing word is dropped first.
    """
    return f"{err.msg.removesuffix(' at')} at line {line} column {err.colno}"


def _object_hint(doc) -> str:
    """What a top-level JSON object holds, for its refusal: a key holding the records (``{"data": [...]}``, as
    `datasets` would need ``field="data"`` for), else its keys."""
    if not isinstance(doc, dict):
        return ""
    lists = [k for k, v in doc.items() if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)]
    turns = any(set(x) & {"role", "from"} for k in lists for x in doc[k])  # a conversation's turns: one record
    if len(lists) == 1 and not turns:
        return (f" whose {lists[0]!r} holds a list of {len(doc[lists[0]])} objects: give those records as the file "
                "(a JSON array, or JSON Lines)")
    keys = ", ".join(repr(k) for k in list(doc)[:8]) + (", ..." if len(doc) > 8 else "")
    return f" with keys {keys} (one record? a JSON file holds an array of them: [{{...}}, {{...}}])" if doc else ""


def _extra_data_message(text: str, err: json.JSONDecodeError) -> str:
    """The text for a whole-file parse that found more after its first JSON value (a record pasted after the
    closing bracket, a merge leftover). A .json file of JSON Lines never gets here: `kinds.sniff` reads it as
    JSON Lines."""
    where = f"line {err.lineno} column {err.colno}"
    start = len(text) - len(text.lstrip(" \t\n\r"))  # JSON's own whitespace, as json.loads skips it
    first, _ = json.JSONDecoder().raw_decode(text, start)  # cannot fail: json.loads got past this value
    return (f"extra data after the JSON {json_type(first)} at {where}: "
            "the file must hold exactly one JSON array of records")


def _decode_whole(data: bytes, problems: list) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        line_start = data.rfind(b"\n", 0, err.start) + 1
        col = len(data[line_start:err.start].decode("utf-8", errors="replace")) + 1
        problems.append(("invalid_utf8", f"invalid UTF-8 byte 0x{data[err.start]:02x} at line {line} column {col}",
                         line))
        return None


def json_type(value: object) -> str:
    """The JSON name of a decoded value's type: object, array, string, boolean, null, number."""
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"


# --- CSV and TSV ----------------------------------------------------------------------------------


class _Lines:
    """A binary file's lines decoded for `csv.reader` (line ends kept), counting them; a line that is not
    UTF-8 is decoded with replacement and remembered, so its record is reported, not the reading stopped."""

    def __init__(self, f):
        self._f = f
        self.count = 0
        self.bad: dict[int, str] = {}  # line -> why it is not UTF-8

    def __iter__(self):
        return self

    def __next__(self) -> str:
        raw = next(self._f)
        self.count += 1
        if self.count == 1:
            raw = raw.removeprefix(BOM)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            self.bad[self.count] = _bad_utf8(raw.rstrip(b"\r\n"), err, self.count).message
            return raw.decode("utf-8", errors="replace")


def _read_delimited(f, kind: str, problems: list, owns) -> Iterator[tuple[int, object]]:
    """One record per row under the header row: {column: cell} without the empty cells."""
    lines = _Lines(f)
    rows = csv.reader(lines, delimiter=_DELIMITERS[base_kind(kind)], strict=True)
    try:
        header = next(rows, None)
    except csv.Error as err:
        problems.append(("invalid_csv", f"cannot read the header row: {err}", 1))
        return
    if header is None or not any(cell.strip() for cell in header):
        problems.append(EMPTY if header is None else ("invalid_csv", "the header row names no column", 1))
        return
    repeated = sorted({name for name in header if name and header.count(name) > 1})
    if repeated:
        problems.append(("invalid_csv", f"the header row names {', '.join(map(repr, repeated))} more than once", 1))
        return
    index = 0
    while True:
        start = lines.count + 1
        try:
            row = next(rows)
        except StopIteration:
            return
        except csv.Error as err:  # an unclosed quote runs to the end of the file: nothing after it is a record
            problems.append(("invalid_csv", f"{err} (the row that starts at line {start})", start))
            return
        if not row or (len(row) == 1 and not row[0].strip()):
            continue  # a blank line
        index += 1
        if owns is not None and not owns(index - 1):
            yield start, SKIPPED
            continue
        bad = next((lines.bad[n] for n in range(start, lines.count + 1) if n in lines.bad), None)
        if bad is not None:
            yield start, Unreadable("invalid_utf8", bad)
        elif len(row) != len(header):
            yield start, Unreadable("invalid_csv", f"the row has {len(row)} cells, the header row {len(header)} "
                                    f"(line {start})")
        else:
            yield start, {name: cell for name, cell in zip(header, row) if name and cell != ""}
