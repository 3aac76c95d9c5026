"""Atomic, verifiable checkpoint directories.

A checkpoint is a directory of plain files (safetensors for tensors, JSON/YAML
for the rest). It is written into a temporary sibling directory, every file is
fsynced, `MANIFEST.json` (sha256 and size of every file, plus the step) is
written last, and only then is the directory renamed into place. So:

- a directory without a MANIFEST is a crash in the middle of a save,
- a MANIFEST whose checksums do not match is a damaged file,
- and neither is ever loaded: `latest_valid` falls back to the previous good
  checkpoint and logs which one it skipped and why.

`AsyncWriter` runs the write on a background thread so the step loop does not
wait on the disk; the state handed to it is already a CPU copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

from pipeline import layout
from pipeline.storage import publish

log = logging.getLogger(__name__)

_TMP_MARK = ".tmp-"


def sha256_file(path: Path, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != layout.MANIFEST_FILE)


def file_entries(paths: list[Path], root: Path) -> dict[str, dict]:
    """{path relative to `root`: {"sha256", "bytes"}} of files, each fsynced first."""
    entries = {}
    for path in paths:
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        entries[str(path.relative_to(root))] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    return entries


def write_manifest(root: Path, step: int, extra: dict | None = None, known: dict[str, dict] | None = None) -> dict:
    """Checksum every file under `root`, fsync them, then write MANIFEST.json last.

    `known`: entries already computed (by the ranks that wrote those files), not hashed again.
    """
    known = known or {}
    entries = {**known, **file_entries([p for p in _files(root) if str(p.relative_to(root)) not in known], root)}
    manifest = {"step": step, "created": time.time(), "files": entries, **(extra or {})}
    tmp = root / (layout.MANIFEST_FILE + ".partial")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / layout.MANIFEST_FILE)
    return manifest


def verify(root: Path) -> tuple[bool, str]:
    """(ok, reason). Checks the MANIFEST exists and every listed file matches it."""
    root = Path(root)
    manifest_path = root / layout.MANIFEST_FILE
    if not manifest_path.is_file():
        return False, f"{manifest_path} is missing (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as err:
        return False, f"{manifest_path} is unreadable: {err}"
    for rel, meta in files.items():
        path = root / rel
        if not path.is_file():
            return False, f"{path} is listed in the MANIFEST but missing"
        if path.stat().st_size != meta["bytes"]:
            return False, f"{path} has {path.stat().st_size} bytes, the MANIFEST says {meta['bytes']} (truncated?)"
        if sha256_file(path) != meta["sha256"]:
            return False, f"{path} does not match its sha256 in the MANIFEST (corrupted)"
    return True, "ok"


def read_manifest(root: Path) -> dict:
    return json.loads((Path(root) / layout.MANIFEST_FILE).read_text())


def write_checkpoint(final: Path, step: int, write_files: Callable[[Path], None], extra: dict | None = None,
                     known: dict[str, dict] | None = None) -> Path:
    """Write a checkpoint atomically: `write_files(tmp_dir)`, MANIFEST (`known` entries not re-hashed), rename."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}{_TMP_MARK}{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_files(tmp)
    write_manifest(tmp, step, extra, known)
    # Only an older attempt at the same step can already be at `final`: swapped out, no gap.
    publish.publish_dir(tmp, final)
    return final


def staging_dir(final: Path, label: str, pid: int) -> Path:
    """A temp sibling of `final` that several processes write into before the commit.

    The DCP shards of every FSDP rank go there, and rank 0's `write_files` moves
    them into the checkpoint. Named like `write_checkpoint`'s own temp dir of
    process `pid`: never listed as a checkpoint, kept by `prune` in process
    `pid`, removed by it when left behind by a dead attempt.
    """
    return Path(final).with_name(f"{Path(final).name}{_TMP_MARK}{label}-{pid}")


def update_latest(scratch: Path, step_dir: Path) -> None:
    publish.write_text(Path(scratch) / layout.LATEST_FILE, step_dir.name + "\n")


def step_dirs(scratch: Path) -> list[Path]:
    """Committed step dirs, newest first (temp dirs are never listed)."""
    scratch = Path(scratch)
    if not scratch.is_dir():
        return []
    dirs = [p for p in scratch.glob(layout.STEP_GLOB) if p.is_dir() and _TMP_MARK not in p.name]
    return sorted(dirs, key=lambda p: layout.step_of(p.name), reverse=True)


def latest_valid(scratch: Path, accept: Callable[[dict], str | None] | None = None) -> Path | None:
    """Newest step dir that verifies (and that `accept(manifest)` does not reject).

    LATEST is a hint only: the newest dir is checked first whatever it says, and
    every skipped dir is logged with the reason, so a corrupt checkpoint is
    visible, never loaded.
    """
    for path in step_dirs(scratch):
        ok, reason = verify(path)
        if ok and accept is not None:
            rejection = accept(read_manifest(path))
            ok, reason = rejection is None, rejection or "ok"
        if ok:
            return path
        log.warning("skipping checkpoint %s: %s", path, reason)
    return None


def prune(scratch: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` committed step dirs; drop stale temp dirs."""
    for path in step_dirs(scratch)[max(1, keep_last):]:
        shutil.rmtree(path, ignore_errors=True)
    for tmp in Path(scratch).glob(f"{layout.STEP_GLOB}{_TMP_MARK}*"):
        if not tmp.name.endswith(str(os.getpid())):
            shutil.rmtree(tmp, ignore_errors=True)


class AsyncWriter:
    """At most one checkpoint write in flight, on a background thread.

    `submit` waits for the previous write to finish first, so checkpoints land
    in order; `wait` re-raises a failure of the background write.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, fn: Callable[[], None]) -> None:
        self.wait()
        if not self.enabled:
            fn()
            return

        def run():
            try:
                fn()
            except BaseException as err:  # surfaced by wait()
                self._error = err

        self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=False)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """A write is in flight (and competing with the step loop for CPU and disk)."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("background checkpoint write failed") from err
