"""The embedded default with DoRA and no validation set (`lora.use_dora=true`, `data.val: null`)
through the whole DAG: pilot, gate, chunks, consolidation, the DoRA merge, its verification and
the smoke test; the merged model loads with stock transformers. One small run, shared by the
module's tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pipeline.evaluate.skipped import GATE_BASIS, NO_VAL
from pipeline.layout import RunTree, log_file
from kits.run import copy_workflow, jobs_in_log, seed_embedded_base, snakemake
from safetensors.torch import load_file

pytestmark = pytest.mark.workflow

RUN = "dora"
OVERRIDES = ["optim.lr=2e-3", "optim.global_batch=32", "optim.micro_batch=16", "optim.warmup_fraction=0.05",
             "ema.rates=[0.9,0.98]", "checkpoint.save_every=10", "lora.use_dora=true"]


@pytest.fixture(scope="module")
def dora_run(embedded_base, tmp_path_factory) -> tuple[Path, str]:
    """(workdir, snakemake's output) of the finished run (on the session's embedded base; no lm-eval
    benchmarks, which no test here reads)."""
    workdir = seed_embedded_base(copy_workflow(tmp_path_factory.mktemp("dora") / "wf"), embedded_base)
    (workdir / "dora.yaml").write_text(yaml.safe_dump({
        "run": RUN,
        "data": {"val": None},
        "evaluate": {"benchmarks": {"tasks": []}},
        "schedule": {"total_updates": 30, "pilot_fraction": 0.2, "num_chunks": 2},
        "train": {"overrides": OVERRIDES},
    }))
    proc = snakemake(workdir, "--cores", "all", "--configfile", "dora.yaml")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    return workdir, log


def test_dora_without_validation_runs_to_the_verified_merged_model(dora_run):
    workdir, log = dora_run
    results = workdir / "results" / RUN
    rules = {rule for rule, _ in jobs_in_log(log)}
    assert {"plan", "train_stage", "pilot_gate", "consolidate", "merge_lora", "verify_merge", "smoke_test"} <= rules
    assert json.loads((results / "pilot_report.json").read_text())["passed"] is True
    # DoRA trained: the exported adapter holds a magnitude per adapted layer, and says use_dora.
    adapter = results / "export" / "adapter_ema"
    assert json.loads((adapter / "adapter_config.json").read_text())["use_dora"] is True
    keys = load_file(str(adapter / "adapter_model.safetensors"))
    magnitudes = [k for k in keys if k.endswith(".lora_magnitude_vector")]
    assert magnitudes and len(magnitudes) == sum(k.endswith(".lora_B.weight") for k in keys)
    verification = json.loads((results / "export" / "verification.json").read_text())
    assert verification["passed"] is True, verification


def test_no_validation_loss_was_computed(dora_run):
    workdir, _ = dora_run
    results = workdir / "results" / RUN
    assert not (results / "data" / "val.safetensors").exists()
    config = yaml.safe_load((results / "train_config.yaml").read_text())
    assert config["tokens"]["val_cache"] is None
    for metrics in (results / "stages").glob("*/metrics.jsonl"):
        events = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        assert not [e for e in events if e.get("event") == "eval" or any(k.startswith("val_") for k in e)], metrics
    for report in (results / "eval").glob("*.json"):
        assert '"perplexity"' not in report.read_text(), report
    assert not (results / "export" / "adapter_best").exists()


def test_the_reports_say_validation_was_skipped(dora_run):
    """The gate judged on training loss and the gate report, the run's log and the overview page
    say there was no validation set, in words, not as a blank or a NaN."""
    workdir, _ = dora_run
    tree = RunTree(workdir / RunTree.of(RUN).root)
    gate = json.loads(tree.pilot_report.read_text())
    assert gate["judged_on"] == "training loss" and gate["skipped"] == [NO_VAL], gate
    assert f"pilot gate: {NO_VAL}; {GATE_BASIS}" in (workdir / log_file("pilot_gate", RUN)).read_text()
    assert f"Skipped: {NO_VAL}." in tree.overview_html.read_text()


def test_merged_dora_model_loads_with_stock_transformers(dora_run):
    import torch
    from transformers import AutoModelForCausalLM

    workdir, _ = dora_run
    merged = workdir / "results" / RUN / "export" / "merged"
    model = AutoModelForCausalLM.from_pretrained(merged)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()
    assert not any("lora" in name for name, _ in model.named_parameters())
