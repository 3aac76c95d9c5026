"""Atomic publication: an output appears whole, and replacing it leaves no moment without it."""

from __future__ import annotations

import threading

import pytest

from pipeline.storage import publish


def test_staged_dir_publishes_whole_and_leaves_nothing_on_failure(tmp_path):
    out = tmp_path / "out"
    with publish.staged_dir(out) as stage:
        (stage / "a").write_text("1")
        assert not out.exists()  # nothing shows before the end
    assert (out / "a").read_text() == "1"
    with pytest.raises(RuntimeError):
        with publish.staged_dir(out) as stage:
            (stage / "a").write_text("2")
            raise RuntimeError("boom")
    assert (out / "a").read_text() == "1"  # the old output is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp dir left behind


def test_replacing_a_dir_never_leaves_it_missing(tmp_path):
    """A reader polling the output while it is replaced 200 times must always find it, whole."""
    out = tmp_path / "out"
    with publish.staged_dir(out) as stage:
        (stage / "v").write_text("0")
    seen, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            try:
                seen.append((out / "v").read_text())
            except FileNotFoundError:
                seen.append(None)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(1, 201):
            with publish.staged_dir(out) as stage:
                (stage / "v").write_text(str(i))
    finally:
        stop.set()
        thread.join()
    assert seen and None not in seen
    assert (out / "v").read_text() == "200"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_write_text_replaces_a_file_in_one_rename(tmp_path):
    path = tmp_path / "sub" / "report.json"
    publish.write_text(path, "first")
    publish.write_text(path, "second")
    assert path.read_text() == "second"
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.json"]
