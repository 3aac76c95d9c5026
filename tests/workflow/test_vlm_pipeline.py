"""The embedded vision-language default through the whole DAG, as the README runs it:
`snakemake --cores all --configfile config/vlm.yaml`; and a bad image dataset stops the DAG at
validation, before anything is trained.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml
from kits.run import copy_workflow, jobs_in_log, snakemake

pytestmark = pytest.mark.workflow

MALFORMED = Path(__file__).resolve().parents[1] / "data" / "malformed"


def test_vlm_default_learns_to_answer_image_questions(tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    proc = snakemake(workdir, "--cores", "all", "--configfile", "config/vlm.yaml")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    summary = pd.read_csv(workdir / "results/vlm/eval/summary.csv")
    em = {(row.stage, row.weights): row.exact_match for row in summary.itertuples()}
    assert em[("base", "base")] <= 0.2
    assert em[("export", "merged")] >= 0.8, summary.to_string()
    assert set(summary["weights"]) == {"base", "raw", "ema_0.9", "ema_0.98", "merged"}
    verification = json.loads((workdir / "results/vlm/export/verification.json").read_text())
    assert verification["passed"] and verification["probe_images"] == 4
    adapter = json.loads((workdir / "results/vlm/export/adapter_ema/adapter_config.json").read_text())
    assert adapter["modules_to_save"] == ["model.multi_modal_projector"]
    prepare = (workdir / "logs/prepare_base/embedded-vlm.log").read_text()
    assert "caption colour accuracy" in prepare


def test_bad_image_dataset_stops_the_dag_at_validation(tiny_llava, tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    bad = MALFORMED / "image_placeholder_missing.jsonl"
    (workdir / "bad.yaml").write_text(yaml.safe_dump({
        "run": "bad", "model": str(tiny_llava["model"]),
        "data": {"train": str(bad), "val": None, "test": None},
    }))
    proc = snakemake(workdir, "--cores", "all", "--configfile", "config/vlm.yaml", "bad.yaml")
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert {"validate_dataset"} <= {rule for rule, _ in jobs_in_log(log)}
    assert not {"tokenize_dataset", "train_stage"} & {rule for rule, _ in jobs_in_log(log)}
    assert not (workdir / "results/bad/stages").exists() and not (workdir / "results/bad/data/train/train/train.safetensors").exists()
    message = (workdir / "logs/validate_dataset/bad/train.log").read_text()
    assert f"{bad} (JSON Lines) record 1 (line 2, id 'm-1') image: image_placeholder_mismatch: " in message
