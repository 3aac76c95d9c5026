"""The run-level data reports of several training datasets, merged from each one's."""

from __future__ import annotations

import json

from pipeline.data.mixed_reports import main


def _report(name: str, records: int, warning: str) -> dict:
    return {"ok": True, "num_problems": 0, "counts": {}, "settings": {"train": f"{name}.jsonl", "val": "val.jsonl",
                                                                      "columns": {}, "roles": {}, "max_length": 64},
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
    stats = json.loads((out / "s.json").read_text())
    assert stats["splits"] == {"train:chat": _stats("chat", 5)["splits"]["train"],
                               "train:domain": _stats("domain", 3)["splits"]["train"], "val": {"records": 4}}
    assert (out / "v.csv").read_text().count("bad val row") == 1  # val / test rows once
