"""Checkpoint directories (`pipeline.checkpoint.io`): written whole or not at all, MANIFEST last; a
damaged or unfinished one is never loaded, and the resume falls back to the newest good one, saying
which it skipped and why. The stage-level guarantees (a SIGKILL or a corrupted checkpoint resumes
bitwise) are tests/train/test_exact_resume.py's."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pipeline import layout
from pipeline.checkpoint import io


def _save(scratch: Path, step: int, payload: bytes = b"weights") -> Path:
    def files(tmp: Path) -> None:
        (tmp / "adapter").mkdir()
        (tmp / "adapter" / "w.bin").write_bytes(payload)
        (tmp / "progress.json").write_text(json.dumps({"step": step}))

    path = io.write_checkpoint(layout.step_dir(scratch, step), step, files)
    io.update_latest(scratch, path)
    return path


def test_a_written_checkpoint_verifies_and_leaves_no_temp_dir(tmp_path):
    path = _save(tmp_path, 5)
    assert io.verify(path) == (True, "ok")
    manifest = io.read_manifest(path)
    assert manifest["step"] == 5 and set(manifest["files"]) == {"adapter/w.bin", "progress.json"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [layout.LATEST_FILE, "step_000005"]


def test_every_kind_of_damage_is_named_with_the_file(tmp_path):
    flipped, cut, unfinished = _save(tmp_path, 1), _save(tmp_path, 2), _save(tmp_path, 3)
    (flipped / "adapter" / "w.bin").write_bytes(b"weightz")  # same size, other bytes
    (cut / "adapter" / "w.bin").write_bytes(b"weig")
    (unfinished / layout.MANIFEST_FILE).unlink()
    assert io.verify(flipped) == (False, f"{flipped / 'adapter/w.bin'} does not match its sha256 in the MANIFEST "
                                         "(corrupted)")
    assert io.verify(cut)[1] == f"{cut / 'adapter/w.bin'} has 4 bytes, the MANIFEST says 7 (truncated?)"
    assert io.verify(unfinished)[1] == f"{unfinished / layout.MANIFEST_FILE} is missing (the save did not finish)"


def test_the_resume_point_is_the_newest_good_checkpoint_and_each_skip_is_logged(tmp_path, caplog):
    good = _save(tmp_path, 10)
    bad = _save(tmp_path, 20)
    (bad / "progress.json").write_text("{}")  # 2 bytes of the 12 `{"step": 20}` had
    (tmp_path / f"step_000030{io._TMP_MARK}999").mkdir()  # a save that died before its rename
    with caplog.at_level(logging.WARNING):
        assert io.latest_valid(tmp_path) == good
    assert [r.getMessage() for r in caplog.records] == [
        f"skipping checkpoint {bad}: {bad / 'progress.json'} has 2 bytes, the MANIFEST says 12 (truncated?)"]
    assert io.latest_valid(tmp_path, accept=lambda m: "another run's" if m["step"] == 10 else None) is None


def test_prune_keeps_the_newest_and_removes_dead_temp_dirs(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    dead = tmp_path / f"step_000004{io._TMP_MARK}1"
    dead.mkdir()
    io.prune(tmp_path, keep_last=2)
    assert [p.name for p in io.step_dirs(tmp_path)] == ["step_000003", "step_000002"] and not dead.exists()
