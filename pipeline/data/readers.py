"""Dataset files: which kind a path is, and its raw records, streamed.

Four kinds (`KINDS`), chosen by the name and confirmed by the content:

* ``json``: one JSON array of records (``.json``; any other name whose first
  non-blank character is ``[``). Parsed whole: JSON has no record boundary to
  stream on, so large datasets belong in JSON Lines or Parquet.
* ``jsonl``: JSON Lines, one object per non-blank line (``.jsonl`` / ``.ndjson``;
  any other text file), read line by line.
* ``parquet``: a Parquet file (``.parquet`` / ``.pq``; the ``PAR1`` magic),
  read one record batch at a time with pyarrow.
* ``arrow``: an Arrow IPC file or stream (``.arrow`` / ``.feather`` / ``.ipc``;
  the ``ARROW1`` magic or a stream's continuation marker), or a directory
  written by ``datasets``' ``save_to_disk`` (``state.json`` /
  ``dataset_info.json`` and its ``.arrow`` shards), memory-mapped and read one
  record batch at a time.

A binary file with a text name (or the reverse) is a problem naming what the
content is, never read as the wrong kind: Parquet read as JSON Lines looks like
a corrupt file. A column that is null in a row of a Parquet / Arrow file is
left out of that record, so a record reads as its JSON Lines twin would.

`read_raw` never raises on bad content: faults go to the caller's problem list
as ``(reason, message, line)``, the records that can be read still come.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
from dataclasses import dataclass
from collections.abc import Iterator
from pathlib import Path

# File kind -> how messages name it.
KINDS = {"json": "JSON", "jsonl": "JSON Lines", "parquet": "Parquet", "arrow": "Arrow"}

_SUFFIXES = {
    ".json": "json", ".jsonl": "jsonl", ".ndjson": "jsonl",
    ".parquet": "parquet", ".pq": "parquet",
    ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow",
}
_PARQUET_MAGIC = b"PAR1"
_ARROW_FILE_MAGIC = b"ARROW1"
_ARROW_STREAM_MAGIC = b"\xff\xff\xff\xff"  # an IPC stream's first message: the continuation marker
# What a `datasets` save_to_disk directory holds beside its shards; a DatasetDict holds this instead.
_DATASET_DIR_FILES = ("state.json", "dataset_info.json")
_DATASET_DICT_FILE = "dataset_dict.json"

_EMPTY = ("empty_file", "the file is empty (or only whitespace)", None)
BATCH_ROWS = 1024  # records per Parquet / Arrow batch: bounded memory whatever the file size
_BOM = b"\xef\xbb\xbf"



@dataclass(frozen=True)
class Unreadable:
    """Yielded in place of a JSON Lines line that could not be decoded: a record that failed, and why."""

    reason: str
    message: str


class KindError(Exception):
    """The path is not a dataset this module reads; `reason` is a stable code, the text says why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def sniff(path: Path) -> str:
    """The kind of `path` (a key of `KINDS`); raises `KindError` when it is none, or not what its name says."""
    if path.is_dir():
        return _sniff_dir(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as err:
        raise KindError("file_not_found", f"cannot read the file: {err.strerror}") from None
    content = _binary_kind(head)
    named = _SUFFIXES.get(path.suffix.lower())
    if named in ("parquet", "arrow") and content != named:
        found = f"it is {KINDS[content]}" if content else "it does not start with its magic bytes"
        raise KindError(f"not_{named}", f"named {path.suffix} but {found} (a truncated or mislabelled file?)")
    if named in ("json", "jsonl") and content:
        raise KindError("wrong_kind", f"named {path.suffix} but it is a {KINDS[content]} file "
                        f"(its first bytes): name it {'.parquet' if content == 'parquet' else '.arrow'}")
    if content:
        return content
    if named:
        return named
    return "json" if _first_non_blank(path) == b"[" else "jsonl"


def _binary_kind(head: bytes) -> str | None:
    if head.startswith(_PARQUET_MAGIC):
        return "parquet"
    if head.startswith(_ARROW_FILE_MAGIC) or head.startswith(_ARROW_STREAM_MAGIC):
        return "arrow"
    return None


def _sniff_dir(path: Path) -> str:
    if (path / _DATASET_DICT_FILE).is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise KindError("dataset_dict", f"a datasets DatasetDict directory (splits: {', '.join(splits)}): "
                        f"give one split's directory, e.g. {path / (splits[0] if splits else 'train')}")
    if not any((path / name).is_file() for name in _DATASET_DIR_FILES) or not _arrow_shards(path):
        raise KindError("not_a_dataset", "a directory, but not one written by datasets' save_to_disk "
                        f"({' / '.join(_DATASET_DIR_FILES)} and .arrow shards)")
    return "arrow"


def _first_non_blank(path: Path) -> bytes:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            stripped = chunk.removeprefix(_BOM).lstrip()
            if stripped:
                return stripped[:1]
    return b""


def fingerprint(path: str | Path) -> str:
    """sha256 of a file's bytes, read in chunks; of a directory, over its files' names and bytes in name order."""
    path = Path(path)
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for p in files:
        if path.is_dir():
            digest.update(str(p.relative_to(path)).encode() + b"\0")
        with open(p, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def columns(path: Path, kind: str) -> list[str] | None:
    """The column names of a Parquet / Arrow dataset (from its schema, no rows read); None for JSON kinds,
    and for a schema that cannot be read (`read_raw` then reports why)."""
    if not is_columnar(kind):
        return None
    import pyarrow as pa

    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            return pq.read_schema(path).names
        first = _arrow_shards(path)[0] if path.is_dir() else path
        with pa.memory_map(str(first)) as source:
            return _open_ipc(source).schema.names
    except (pa.ArrowException, OSError):
        return None


def read_raw(path: Path, kind: str, problems: list) -> Iterator[tuple[int | None, object]]:
    """(line or None, raw record) for every record of `path`, in file order.

    A fault of the file appends ``(reason, message, line or None)`` to
    `problems`; a JSON Lines line that cannot be decoded is yielded as an
    `Unreadable` (a record that failed: the numbering stays the file's). A
    Parquet / Arrow fault mid-file ends the reading there.
    """
    if kind == "json":
        yield from _read_json_array(path, problems)
    elif kind == "jsonl":
        yield from _read_jsonl(path, problems)
    else:
        yield from _read_columnar(path, kind, problems)


# --- JSON and JSON Lines --------------------------------------------------------------------------


def _read_json_array(path: Path, problems: list) -> Iterator[tuple[None, object]]:
    text = _decode_whole(path.read_bytes().removeprefix(_BOM), problems)
    if text is None:
        return
    if not text.strip():
        problems.append(_EMPTY)
        return
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        message = _extra_data_message(text, err) if err.msg == "Extra data" else _decode_error_text(err, err.lineno)
        problems.append(("invalid_json", message, err.lineno))
        return
    if not isinstance(doc, list):
        problems.append(("wrong_top_level_type", f"expected a JSON array of records, found a JSON {json_type(doc)}",
                         None))
        return
    for raw in doc:
        yield None, raw


def _read_jsonl(path: Path, problems: list) -> Iterator[tuple[int, object]]:
    """One record per non-blank line; a bad line is a problem, the others still count."""
    blank = True
    with open(path, "rb") as f:
        for lineno, raw_line in enumerate(f, start=1):
            if lineno == 1:
                raw_line = raw_line.removeprefix(_BOM)
            raw_line = raw_line.rstrip(b"\r\n")
            try:
                text = raw_line.decode("utf-8")
            except UnicodeDecodeError as err:
                col = len(raw_line[:err.start].decode("utf-8", errors="replace")) + 1
                blank = False
                yield lineno, Unreadable("invalid_utf8", f"invalid UTF-8 byte 0x{raw_line[err.start]:02x} "
                                         f"at line {lineno} column {col}")
                continue
            if not text.strip():
                continue
            blank = False
            try:
                yield lineno, json.loads(text)
            except json.JSONDecodeError as err:
                yield lineno, Unreadable("invalid_json", _decode_error_text(err, lineno))
    if blank:
        problems.append(_EMPTY)


def _decode_error_text(err: json.JSONDecodeError, line: int) -> str:
    """json's reason plus where, e.g. 'Unterminated string starting at line 2 column 9'.

    Some of json's reasons already end in " at" ("Unterminated string starting
    at", "Invalid control character at"): appending " at line ..." would say
    "at at", so that trailing word is dropped first.
    """
    return f"{err.msg.removesuffix(' at')} at line {line} column {err.colno}"


def _extra_data_message(text: str, err: json.JSONDecodeError) -> str:
    """The text for a whole-file parse that found more after its first JSON value.

    Only content that looks like JSON Lines gets the "name the file .jsonl"
    hint; a complete array followed by anything else (a record pasted after
    the closing bracket, a merge leftover) is reported as exactly that.
    """
    where = f"line {err.lineno} column {err.colno}"
    if _looks_like_jsonl(text):
        return (f"several JSON objects, one per line (the second starts at {where}): "
                "this looks like JSON Lines; name the file .jsonl, or wrap the records in a JSON array")
    start = len(text) - len(text.lstrip(" \t\n\r"))  # JSON's own whitespace, as json.loads skips it
    first, _ = json.JSONDecoder().raw_decode(text, start)  # cannot fail: json.loads got past this value
    return (f"extra data after the JSON {json_type(first)} at {where}: "
            "the file must hold exactly one JSON array of records")


def _looks_like_jsonl(text: str) -> bool:
    """True if the first two non-blank lines are each a complete JSON object (one record per line)."""
    first_two = list(itertools.islice((line for line in io.StringIO(text) if line.strip()), 2))
    return len(first_two) == 2 and all(_is_json_object(line) for line in first_two)


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


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


# --- Parquet and Arrow ----------------------------------------------------------------------------


def _read_columnar(path: Path, kind: str, problems: list) -> Iterator[tuple[None, object]]:
    import pyarrow as pa

    read = 0
    try:
        for batch in _batches(path, kind):
            for row in batch.to_pylist():
                read += 1
                yield None, {key: value for key, value in row.items() if value is not None}
    except (pa.ArrowException, OSError) as err:  # a corrupt footer, a truncated shard, ...
        where = f" after {read} record(s)" if read else ""
        problems.append((f"invalid_{kind}", f"cannot read the {KINDS[kind]} data{where}: {err}", None))


def _batches(path: Path, kind: str):
    """The record batches of a Parquet file, an Arrow IPC file or stream, or a save_to_disk dir's shards."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        with pq.ParquetFile(path) as f:
            yield from f.iter_batches(batch_size=BATCH_ROWS)
        return
    import pyarrow as pa

    for shard in (_arrow_shards(path) if path.is_dir() else [path]):
        with pa.memory_map(str(shard)) as source:
            reader = _open_ipc(source)
            if isinstance(reader, pa.ipc.RecordBatchFileReader):
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                batches = reader
            for batch in batches:
                # A shard's batches can be large (datasets writes 1000s of rows each): slice, not copy.
                for start in range(0, batch.num_rows, BATCH_ROWS):
                    yield batch.slice(start, BATCH_ROWS)


def _open_ipc(source):
    """An Arrow IPC file reader if `source` has the file magic, else a stream reader."""
    import pyarrow as pa

    head = source.read(len(_ARROW_FILE_MAGIC))
    source.seek(0)
    return pa.ipc.open_file(source) if head == _ARROW_FILE_MAGIC else pa.ipc.open_stream(source)


def _arrow_shards(path: Path) -> list[Path]:
    """A save_to_disk directory's shards, in the order its state.json lists them (else by name)."""
    state = path / "state.json"
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
        return [path / name for name in names]
    except (OSError, ValueError, KeyError, TypeError):
        return sorted(p for p in path.glob("*.arrow") if p.is_file())


def describe_kind(kind: str | None) -> str:
    """'JSON Lines' for 'jsonl'; '' for an unknown kind."""
    return KINDS.get(kind or "", "")


def is_columnar(kind: str) -> bool:
    return kind in ("parquet", "arrow")


