"""Which kind of dataset a path is: chosen by its name, confirmed by its first bytes.

Kinds (`KINDS`): ``json`` (one JSON array), ``jsonl`` (JSON Lines), ``csv`` /
``tsv`` (a header row, then one record per row), ``parquet``, ``arrow`` (an IPC
file or stream, or a ``datasets`` ``save_to_disk`` directory). A directory of data
files of one kind (`shard_files`), or the files a glob matches (`glob_files`: ``data/train-*.parquet``), is of
their kind, read one file after another. A text kind may
be compressed (`CODECS`: ``.gz``, ``.zst``, ``.bz2``, ``.xz``); its kind is then
``<kind>.<codec>``, e.g. ``jsonl.gz``, and the codec is confirmed by its magic
bytes as well. A file named ``.json`` that holds JSON Lines (its first two lines each
one object) is JSON Lines, and one named ``.jsonl`` that holds a JSON array is JSON, as
the `datasets` json loader reads them.

Anything else -- a spreadsheet, a ``.txt``, a ZIP archive, a file whose name
says one kind and whose bytes another -- is a `KindError` with one line naming
the kind found and the kinds accepted: reading it as JSON Lines would report
every line of it as a broken record.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.storage import globs
from pipeline.storage.globs import is_glob

# Base kind -> how messages name it.
KINDS = {"json": "JSON", "jsonl": "JSON Lines", "csv": "CSV", "tsv": "TSV", "parquet": "Parquet", "arrow": "Arrow"}
TEXT_KINDS = ("json", "jsonl", "csv", "tsv")
COLUMNAR_KINDS = ("parquet", "arrow")

# Compression codec (its file suffix) -> (magic bytes, how messages name it).
CODECS = {
    "gz": (b"\x1f\x8b", "gzip"),
    "zst": (b"\x28\xb5\x2f\xfd", "zstandard"),
    "bz2": (b"BZh", "bzip2"),
    "xz": (b"\xfd7zXZ\x00", "xz"),
}
_CODEC_SUFFIXES = {".gz": "gz", ".gzip": "gz", ".zst": "zst", ".zstd": "zst", ".bz2": "bz2", ".xz": "xz"}

_SUFFIXES = {
    ".json": "json", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv", ".tab": "tsv",
    ".parquet": "parquet", ".pq": "parquet",
    ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow",
}
# What a file named otherwise is, for the one-line refusal (a name alone; the bytes may say more).
_OTHER_SUFFIXES = {
    ".txt": "plain text (.txt)", ".text": "plain text", ".md": "Markdown text", ".xlsx": "an Excel workbook (.xlsx)",
    ".xlsm": "an Excel workbook (.xlsm)", ".xls": "an Excel workbook (.xls)", ".ods": "an OpenDocument spreadsheet",
    ".zip": "a ZIP archive", ".tar": "a tar archive", ".7z": "a 7-Zip archive", ".yaml": "YAML", ".yml": "YAML",
    ".xml": "XML", ".html": "HTML", ".pdf": "PDF", ".pkl": "a Python pickle", ".pickle": "a Python pickle",
    ".h5": "HDF5", ".hdf5": "HDF5", ".avro": "Avro", ".orc": "ORC", ".db": "a database file",
    ".sqlite": "an SQLite database", ".npy": "a NumPy array", ".npz": "NumPy arrays", ".pt": "a torch file",
}
_TEXT_SUFFIXES = (".txt", ".text")  # read when the content is JSON or JSON Lines
# First bytes of kinds we do not read -> what they are.
_OTHER_MAGIC = {
    b"PK\x03\x04": "a ZIP archive (an Excel .xlsx workbook is one)",
    b"\xd0\xcf\x11\xe0": "an OLE file (an Excel .xls workbook is one)",
    b"%PDF": "PDF",
    b"SQLite format 3": "an SQLite database",
    b"\x89HDF": "HDF5",
    b"\x93NUMPY": "a NumPy array",
    b"ORC": "ORC",
    b"Obj\x01": "Avro",
}
_PARQUET_MAGIC = b"PAR1"
_ARROW_FILE_MAGIC = b"ARROW1"
_ARROW_STREAM_MAGIC = b"\xff\xff\xff\xff"  # an IPC stream's first message: the continuation marker
# What a `datasets` save_to_disk directory holds beside its shards; a DatasetDict holds this instead.
DATASET_DIR_FILES = ("state.json", "dataset_info.json")
_DATASET_DICT_FILE = "dataset_dict.json"
BOM = b"\xef\xbb\xbf"


class KindError(Exception):
    """The path is not a dataset this pipeline reads; `reason` is a stable code, the text says why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def accepted() -> str:
    """The kinds accepted, as the refusals list them."""
    return ("JSON (.json), JSON Lines (.jsonl, .ndjson), CSV (.csv), TSV (.tsv), Parquet (.parquet), Arrow (.arrow, "
            "or a datasets save_to_disk directory); the text kinds also compressed (.gz, .zst, .bz2, .xz)")


def unsupported(found: str) -> KindError:
    """The one-line refusal of a file of another kind."""
    return KindError("unsupported_kind", f"{found}: not a dataset kind this pipeline reads; accepted: {accepted()}")


def base_kind(kind: str) -> str:
    """'jsonl' for 'jsonl' and 'jsonl.gz'."""
    return kind.partition(".")[0]


def codec_of(kind: str) -> str | None:
    """'gz' for 'jsonl.gz'; None for an uncompressed kind."""
    return kind.partition(".")[2] or None


def describe_kind(kind: str | None) -> str:
    """'JSON Lines' for 'jsonl', 'JSON Lines, gzip' for 'jsonl.gz'; '' for an unknown kind."""
    base = KINDS.get(base_kind(kind or ""))
    if base is None:
        return ""
    codec = codec_of(kind)
    return f"{base}, {CODECS[codec][1]}" if codec in CODECS else base


def is_columnar(kind: str) -> bool:
    return kind in COLUMNAR_KINDS


def sniff(path: Path) -> str:
    """The kind of `path` (see the module docstring); raises `KindError` when it is none, or not what its name says."""
    matched = glob_files(path)
    if matched is not None:
        if not matched:
            raise KindError("no_match", f"no data file matches the glob ({accepted()})")
        root = globs.root(path)
        return sniff_files(matched, [f.relative_to(root).as_posix() for f in matched])
    if path.is_dir():
        return _sniff_dir(path)
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as err:
        raise KindError("file_not_found", f"cannot read the file: {err.strerror}") from None
    suffixes = [s.lower() for s in path.suffixes]
    named_codec = _CODEC_SUFFIXES.get(suffixes[-1]) if suffixes else None
    found_codec = next((codec for codec, (magic, _) in CODECS.items() if head.startswith(magic)), None)
    if named_codec or found_codec:
        return _sniff_compressed(path, suffixes, named_codec, found_codec)
    content = _binary_kind(head)
    suffix = suffixes[-1] if suffixes else ""
    named = _SUFFIXES.get(suffix)
    if named in COLUMNAR_KINDS and content != named:
        found = f"it is {KINDS[content]}" if content else "it does not start with its magic bytes"
        raise KindError(f"not_{named}", f"named {path.suffix} but {found} (a truncated or mislabelled file?)")
    if named in TEXT_KINDS and content:
        raise KindError("wrong_kind", f"named {path.suffix} but it is a {KINDS[content]} file "
                        f"(its first bytes): name it {'.parquet' if content == 'parquet' else '.arrow'}")
    if content:
        return content
    if named == "json" and _json_lines_inside(path, None):
        return "jsonl"
    if named == "jsonl" and _json_array_inside(path, None):
        return "json"
    if named:
        return named
    other = next((what for magic, what in _OTHER_MAGIC.items() if head.startswith(magic)), None)
    if other is not None:
        raise unsupported(_OTHER_SUFFIXES.get(suffix) or f"named {suffix or 'without a suffix'}, {other}")
    if suffix in _OTHER_SUFFIXES and suffix not in _TEXT_SUFFIXES:
        raise unsupported(_OTHER_SUFFIXES[suffix])
    # Any other name (none, .data, .txt): JSON or JSON Lines by the content, else refused naming what it is.
    first = _first_non_blank(path)
    if first == b"[":
        return "json"
    if first == b"{":
        return "jsonl"
    what = f"starting with {first.decode(errors='replace')!r}" if first else "empty"
    named = _OTHER_SUFFIXES.get(suffix, f"a file named {suffix or 'without a suffix'}")
    raise unsupported(f"{named}, {what} (neither a JSON array nor JSON Lines)")


def _sniff_compressed(path: Path, suffixes: list[str], named: str | None, found: str | None) -> str:
    if named != found:
        if named is None:
            inner = "".join(path.suffixes) or ""
            raise KindError("wrong_kind", f"named {inner or 'without a suffix'} but it is {CODECS[found][1]}-"
                            f"compressed (its first bytes): name it {path.name}.{found}")
        what = f"{CODECS[found][1]}-compressed" if found else "not compressed"
        raise KindError(f"not_{named}", f"named {suffixes[-1]} but it is {what} (its first bytes): a truncated or "
                        "mislabelled file?")
    inner = _SUFFIXES.get(suffixes[-2]) if len(suffixes) > 1 else None
    if inner in COLUMNAR_KINDS:
        raise unsupported(f"a {CODECS[found][1]}-compressed {KINDS[inner]} file (compress its columns inside "
                          f"the file instead)")
    if inner == "json" and _json_lines_inside(path, found):
        inner = "jsonl"
    elif inner == "jsonl" and _json_array_inside(path, found):
        inner = "json"
    if inner is None:
        first = _first_non_blank_of(_open_decompressed(path, found))
        inner = "json" if first == b"[" else "jsonl" if first == b"{" else None
        if inner is None:
            raise unsupported(f"{CODECS[found][1]}-compressed, named {''.join(path.suffixes)}, not JSON or JSON Lines "
                              "inside (give the inner kind in the name, e.g. train.csv.gz)")
    return f"{inner}.{found}"


def _json_lines_inside(path: Path, codec: str | None) -> bool:
    """Whether a file named .json (or .json.gz, ...) holds JSON Lines: its first two non-blank lines are each one
    whole JSON object. `datasets`' json loader reads such a file as JSON Lines, and so do we (many dataset repos
    name their JSON Lines .json)."""
    lines = _first_lines(path, codec, b"{")  # an array (however long its first line) is not read further
    try:
        return len(lines) == 2 and all(isinstance(json.loads(line), dict) for line in lines)
    except ValueError:  # not JSON (UnicodeDecodeError is one)
        return False


def _json_array_inside(path: Path, codec: str | None) -> bool:
    """Whether a file named .jsonl holds one JSON array (`json.dump` of a list writes it on one line): it starts
    with ``[`` and is not lines of arrays (its first line a whole array and another line after it)."""
    lines = _first_lines(path, codec, b"[")
    if len(lines) < 2:
        return bool(lines)
    try:
        return not isinstance(json.loads(lines[0]), list)
    except ValueError:  # the array goes on past its first line
        return True


def _first_lines(path: Path, codec: str | None, starting: bytes) -> list[bytes]:
    """The first two non-blank lines of a text file whose first non-blank byte is `starting`; [] when it is not."""
    opened = lambda: _open_decompressed(path, codec) if codec else open(path, "rb")
    lines = []
    try:
        with opened() as f:
            if _first_non_blank_of(f) != starting:
                return []
        with opened() as f:
            for raw in f:
                if raw.strip(b" \t\r\n"):
                    lines.append(raw.removeprefix(BOM))
                    if len(lines) == 2:
                        break
    except stream_errors():  # a truncated or corrupt stream: what came before it (reading it says the rest)
        pass
    return lines


def stream_errors() -> tuple[type[Exception], ...]:
    """What a broken compressed stream raises (gzip and bz2: OSError / EOFError)."""
    import lzma

    errors: tuple[type[Exception], ...] = (OSError, EOFError, lzma.LZMAError)
    try:
        import zstandard

        errors += (zstandard.ZstdError,)
    except ImportError:
        pass
    return errors


def open_binary(path: Path, kind: str):
    """The file's bytes as a binary file object, decompressed for a compressed kind."""
    codec = codec_of(kind)
    return _open_decompressed(path, codec) if codec else open(path, "rb")


def _open_decompressed(path: Path, codec: str):
    if codec == "gz":
        import gzip

        return gzip.open(path, "rb")
    if codec == "bz2":
        import bz2

        return bz2.open(path, "rb")
    if codec == "xz":
        import lzma

        return lzma.open(path, "rb")
    import io

    import zstandard

    # Buffered: zstandard's reader reads, but does not iterate over lines.
    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True,
                                                                        read_across_frames=True), 1 << 20)


def _binary_kind(head: bytes) -> str | None:
    if head.startswith(_PARQUET_MAGIC):
        return "parquet"
    if head.startswith(_ARROW_FILE_MAGIC) or head.startswith(_ARROW_STREAM_MAGIC):
        return "arrow"
    return None


# Split names in a data file's name (train-00000-of-00002.parquet, data/test.jsonl): files of several in one
# directory are not one dataset.
_SPLIT_WORDS = {"train": "train", "training": "train", "validation": "validation", "valid": "validation",
                "val": "validation", "dev": "validation", "test": "test", "testing": "test", "eval": "validation"}


def shard_files(path: Path) -> list[Path] | None:
    """The data files of a directory that holds one dataset in several files (what `hf download` leaves of a
    dataset repo's folder, or a partitioned write): its files with a data kind's name (`_SUFFIXES`, compressed
    too), sorted by their path in it, hidden ones left out; other files (README.md, images) are not data. None
    for a save_to_disk or DatasetDict directory, or a directory with no data file. `KindError` when the names
    say several splits (train-*.parquet beside test-*.parquet): give the split's own files."""
    if not path.is_dir() or (path / _DATASET_DICT_FILE).is_file() or any((path / n).is_file()
                                                                          for n in DATASET_DIR_FILES):
        return None
    return _one_split(_data_files(path.rglob("*"), path), path,
                      "a directory holding the files of several splits ({found}): give one split's directory, or a "
                      "glob of its files (data/train-*.parquet) as data.train / data.val / data.test") or None


def glob_files(path: str | Path) -> list[Path] | None:
    """The data files a glob names (`pipeline.storage.globs`: ``data/train-*.parquet``, ``shards/**/*.jsonl``):
    those with a data kind's name, sorted by their path below its fixed directories (`globs.root`), hidden ones
    left out (as in a directory, `shard_files`); [] when none matches. None when `path` is no glob (`is_glob`).
    `KindError` when the names say several splits."""
    if not is_glob(path):
        return None
    root = globs.root(path)
    return _one_split(_data_files(globs.matches(path), root), root,
                      "a glob matching the files of several splits ({found}): narrow it to one split's files")


def _data_files(paths, root: Path) -> list[Path]:
    """The files among `paths` with a data kind's name, none hidden below `root`, sorted by their path there."""
    return sorted((p for p in paths if p.is_file() and data_name(p)
                   and not any(part.startswith(".") for part in p.relative_to(root).parts)),
                  key=lambda p: p.relative_to(root).as_posix())


def _one_split(files: list[Path], root: Path, message: str) -> list[Path]:
    """`files`, when their names (below `root`) name one split or none; else `KindError` (`message` with
    {found}: the splits and their counts)."""
    splits: dict[str, int] = {}
    for f in files:
        words = {_SPLIT_WORDS[w] for w in _words(f.relative_to(root).as_posix()) if w in _SPLIT_WORDS}
        for split in words:
            splits[split] = splits.get(split, 0) + 1
    if len(splits) > 1:
        found = ", ".join(f"{split}: {n} file(s)" for split, n in sorted(splits.items()))
        raise KindError("several_splits", message.format(found=found))
    return files


def sniff_files(files: list[Path], names: list[str]) -> str:
    """The one kind of a dataset's several files (`names`: how messages name them); `KindError` naming the file
    that is none, or the kinds found."""
    found: dict[str, str] = {}
    for f, name in zip(files, names):
        try:
            found.setdefault(sniff(f), name)
        except KindError as err:
            raise KindError(err.reason, f"{name}: {err}") from None
    if len(found) > 1:
        named = ", ".join(f"{name} ({describe_kind(kind)})" for kind, name in found.items())
        raise KindError("mixed_kinds", f"the files are of several kinds: {named}; give files of one kind")
    return next(iter(found))


def _words(name: str) -> list[str]:
    return [w for w in "".join(c if c.isalnum() else " " for c in name.lower()).split()]


def data_name(path: Path) -> bool:
    """Whether the file name is a data kind's (`_SUFFIXES`, compressed too): what a folder or glob of data files reads."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _CODEC_SUFFIXES:
        suffixes = suffixes[:-1]
    return bool(suffixes) and suffixes[-1] in _SUFFIXES


def _sniff_dir(path: Path) -> str:
    files = shard_files(path)
    if files:
        return sniff_files(files, [f.relative_to(path).as_posix() for f in files])
    if (path / _DATASET_DICT_FILE).is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise KindError("dataset_dict", f"a datasets DatasetDict directory (splits: {', '.join(splits)}): "
                        f"give one split's directory, e.g. {path / (splits[0] if splits else 'train')}")
    if not any((path / name).is_file() for name in DATASET_DIR_FILES) or not arrow_shards(path):
        raise KindError("not_a_dataset", "a directory, but neither one written by datasets' save_to_disk "
                        f"({' / '.join(DATASET_DIR_FILES)} and .arrow shards) nor one holding data files "
                        f"({accepted()})")
    return "arrow"


def arrow_shards(path: Path) -> list[Path]:
    """A save_to_disk directory's shards, in the order its state.json lists them (else by name)."""
    state = path / "state.json"
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
        return [path / name for name in names]
    except (OSError, ValueError, KeyError, TypeError):
        return sorted(p for p in path.glob("*.arrow") if p.is_file())


def _first_non_blank(path: Path) -> bytes:
    with open(path, "rb") as f:
        return _first_non_blank_of(f)


def _first_non_blank_of(f) -> bytes:
    """The first non-blank byte of a binary file object (closed after)."""
    with f:
        while chunk := f.read(1 << 16):
            stripped = chunk.removeprefix(BOM).lstrip()
            if stripped:
                return stripped[:1]
    return b""
