"""The run-level data reports of several training datasets, merged from each one's."""

from __future__ import annotations

import json

from pipeline.data.mixed_reports import main


def _report(name: str, records: int, warning: str) -> dict:
    settings = {"train": f"{name}.jsonl", "val": "val.jsonl", "columns": {}, "roles": {}, "image_dir": f"/images/{name}",
                "max_length": 64}
    return {"ok": True, "num_problems": 0, "counts": {}, "settings": settings,
            "notes": ["val: shared note"], "files": {"train": {"records": records}, "val": {"records": 4}},
            "problems": [], "warnings": [{"split": "train", "reason": "duplicate_sample", "message": warning},
                                         {"split": "val", "reason": "duplicate_sample", "message": "in val"}]}


def _stats(name: str, records: int) -> dict:
    return {"max_length": 64, "splits": {"train": {"source": f"{name}.jsonl", "records": records, "tokens": 9}}}


def test_each_dataset_is_a_split_of_its_own_and_val_appears_once(tmp_path):
    dirs = []
    for name, records in (("chat", 5), ("domain", 3)):
        d = tmp_path / name
        d.mkdir()
        (d / "validation.json").write_text(json.dumps(_report(name, records, f"copy in {name}")))
        (d / "validation.csv").write_text("split,reason,message\nval,x,bad val row\n")
        (d / "stats.json").write_text(json.dumps(_stats(name, records)))
        dirs += ["--dataset", f"{name}={d}"]
    (tmp_path / "val_stats.json").write_text(json.dumps({"splits": {"val": {"records": 4}}}))
    out = tmp_path / "out"
    assert main([*dirs, "--val-stats", str(tmp_path / "val_stats.json"), "--out-json", str(out / "v.json"),
                 "--out-csv", str(out / "v.csv"), "--out-stats", str(out / "s.json")]) == 0
    merged = json.loads((out / "v.json").read_text())
    assert merged["ok"] and list(merged["files"]) == ["train:chat", "train:domain", "val"]
    assert merged["files"]["train:domain"] == {"records": 3}
    assert [w["split"] for w in merged["warnings"]] == ["train:chat", "train:domain", "val"]
    assert merged["notes"] == ["val: shared note"]
    assert merged["datasets"]["chat"]["path"] == "chat.jsonl" and "train" not in merged["settings"]
    assert merged["datasets"]["domain"] == {"path": "domain.jsonl", "columns": {}, "roles": {},
                                            "image_dir": "/images/domain"}
    stats = json.loads((out / "s.json").read_text())
    assert stats["splits"] == {"train:chat": _stats("chat", 5)["splits"]["train"],
                               "train:domain": _stats("domain", 3)["splits"]["train"], "val": {"records": 4}}
    assert (out / "v.csv").read_text().count("bad val row") == 1  # val / test rows once


def test_one_training_file_keeps_its_reports_and_the_page_shows_its_shards(tmp_path):
    """A run of one file (a mix of one): its reports as they are (split `train`), val stats added; shards.json and
    the data page show each shard's records and times."""
    d = tmp_path / "train"
    d.mkdir()
    report = _report("only", 7, "copy")
    (d / "validation.json").write_text(json.dumps(report))
    (d / "validation.csv").write_text("split,reason,message\ntrain,x,row\n")
    (d / "stats.json").write_text(json.dumps(_stats("only", 7)))
    for step, seconds in (("validate", 1.5), ("tokenize", 2.5)):
        (d / f"{step}_shards.json").write_text(json.dumps({"shards": [
            {"shard": k, "records": 4 - k, "seconds": seconds + k, "cpu_seconds": 1.0} for k in range(2)]}))
    (tmp_path / "val_stats.json").write_text(json.dumps({"splits": {"val": {"records": 4}}}))
    out = tmp_path / "out"
    assert main(["--dataset", f"train={d}", "--val-stats", str(tmp_path / "val_stats.json"),
                 "--out-json", str(out / "v.json"), "--out-csv", str(out / "v.csv"), "--out-stats", str(out / "s.json"),
                 "--out-shards", str(out / "shards.json"), "--out-html", str(out / "data.html")]) == 0
    assert json.loads((out / "v.json").read_text()) == report
    assert (out / "v.csv").read_text() == (d / "validation.csv").read_text()
    assert list(json.loads((out / "s.json").read_text())["splits"]) == ["train", "val"]
    shards = json.loads((out / "shards.json").read_text())["train"]
    assert shards["shards"] == 2 and [s["seconds"] for s in shards["tokenize"]] == [2.5, 3.5]
    page = (out / "data.html").read_text()
    assert "<td>train</td><td>1</td><td>3</td><td>2.5 (1.0)</td><td>3.5 (1.0)</td>" in page
