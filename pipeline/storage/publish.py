"""Atomic publication: an output appears whole, and an old one is replaced with no gap.

Every command that writes a directory or a small file builds it in a hidden
sibling first and then publishes it here, so a crash never leaves something
that looks finished (Snakemake would take a partial dir for a result), and a
reader never finds the output missing while an old copy is being replaced:

* a new path is a plain `rename`;
* an existing directory is swapped with the new one in one `renameat2(...,
  RENAME_EXCHANGE)` call (Linux >= 3.15), after which the old contents sit in
  the temp name and are deleted. Where that call does not exist (another OS, an
  old kernel, a file system without it) the old dir is renamed aside first: the
  gap is then two renames long, never a recursive delete.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_libc = None


def _renameat2():
    """libc's renameat2, or None where it does not exist."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        except OSError:
            _libc = False
    return getattr(_libc, "renameat2", None) if _libc else None


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically; False when the system cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_dir(tmp: Path | str, final: Path | str) -> None:
    """Make the fully written dir `tmp` appear as `final`, replacing an old `final` with no gap.

    `tmp` must be a sibling of `final` (same file system). Afterwards `tmp` no
    longer exists. The parent dir is fsynced, so the rename survives a power cut.
    """
    tmp, final = Path(tmp), Path(final)
    if not final.exists():
        os.replace(tmp, final)
    elif _exchange(tmp, final):
        shutil.rmtree(tmp)  # now holds the old contents
    else:
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(final.parent)


def temp_sibling(final: Path | str, label: str = "tmp") -> Path:
    """A hidden, process-specific sibling path of `final` to build it in (removed if left over)."""
    final = Path(final)
    tmp = final.with_name(f".{final.name}.{label}-{os.getpid()}")
    if tmp.is_dir():
        shutil.rmtree(tmp)
    elif tmp.exists():
        tmp.unlink()
    return tmp


@contextmanager
def staged_dir(out: Path | str) -> Iterator[Path]:
    """Yield an empty temp dir; on normal exit it is published as `out` (`publish_dir`).

    On an exception the temp dir is removed and `out` is left as it was.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = temp_sibling(out, "partial")
    stage.mkdir()
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    publish_dir(stage, out)


@contextmanager
def staged_file(path: Path | str) -> Iterator[Path]:
    """Yield a temp path to write the file to; on normal exit it replaces `path` in one rename.

    On an exception the temp file is removed and `path` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: Path | str, text: str) -> None:
    """Write a small file so that readers never see half of it (`staged_file`)."""
    with staged_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: Path | str, payload: object, *, sort_keys: bool = True) -> None:
    """`write_text` of `payload` as indented JSON."""
    write_text(path, json.dumps(payload, indent=2, sort_keys=sort_keys) + "\n")
