"""The embedded default with a 4-bit base (model.quantization=nf4, QLoRA) and no held-out test
file (data.test: null), through the whole DAG: plan, pilot and gate, chunks, every evaluation,
consolidation, the streaming merge, its verification and the smoke test.

One short run (30 updates) is shared by every test here (module fixture). What it shows:
the stages and every evaluation load the base quantized; without a test file no exact-match
evaluation runs, yet the DAG reaches the merged model; the merged model loads with stock
transformers and equals the *unquantized* base files + the adapter's delta computed in fp32
(never a dequantized copy); the verification says which base each side used.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from kits.run import copy_workflow, jobs_in_log, seed_embedded_base, snakemake
from safetensors.torch import load_file

from pipeline import layout
from pipeline.evaluate.skipped import NO_TEST

pytestmark = pytest.mark.workflow

RUN = "qlora"
SCHEDULE = {"total_updates": 30, "pilot_fraction": 0.2, "num_chunks": 2}  # pilot 6 + 12 + 12


@pytest.fixture(scope="module")
def nf4_run(embedded_base, tmp_path_factory):
    workdir = seed_embedded_base(copy_workflow(tmp_path_factory.mktemp("nf4-run")), embedded_base)
    default = yaml.safe_load((workdir / "config" / "config.yaml").read_text())
    variant = {"run": RUN, "data": {**default["data"], "test": None}, "schedule": SCHEDULE,
               "train": {**default["train"], "overrides": [*default["train"]["overrides"], "model.quantization=nf4"]}}
    (workdir / "qlora.yaml").write_text(yaml.safe_dump(variant))
    proc = snakemake(workdir, "--cores", "all", "--configfile", "qlora.yaml", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return workdir, proc.stdout + proc.stderr



def test_the_whole_dag_runs_with_a_4bit_base_and_no_test_file(nf4_run):
    workdir, log = nf4_run
    ran = [rule for rule, _ in jobs_in_log(log)]
    for rule in ("plan", "train_stage", "pilot_gate", "evaluate_stage", "consolidate", "merge_lora", "verify_merge",
                 "smoke_test"):
        assert rule in ran, (rule, sorted(set(ran)))
    results = workdir / "results" / RUN
    assert "quantization: nf4" in (results / layout.TRAIN_CONFIG_FILE).read_text()
    # Every stage trained, and every evaluation (the base's included) ran, on the 4-bit base.
    logs = workdir / "logs"
    loaded = {str(p.relative_to(logs)) for p in logs.rglob("*.log") if "model.quantization=nf4: " in p.read_text()}
    expected = {f"train_stage/{RUN}/{s}.log" for s in ("pilot", "chunk01", "chunk02")}
    expected |= {f"evaluate_stage/{RUN}/{s}.log" for s in (layout.BASE_EVAL, "pilot", "chunk01", "chunk02")}
    assert expected <= loaded, sorted(loaded)
    # No test file: no exact-match evaluation, the losses only.
    evals = sorted((results / "eval").glob("*.json"))
    rows = [row for path in evals for row in json.loads(path.read_text()).get("rows", [])]
    assert rows and all("exact_match" not in row and "loss" in row for row in rows), rows[:2]
    assert json.loads((results / "pilot_report.json").read_text())["passed"]


def test_the_reports_say_exact_match_was_skipped(nf4_run):
    """No test file: the smoke test records no score (not a 0.0 over a probe), and the smoke test's
    log, the summary and the overview page say exact match was skipped."""
    workdir, _ = nf4_run
    tree = layout.RunTree(workdir / layout.RunTree.of(RUN).root)
    smoke = json.loads(tree.smoke_test.read_text())
    assert smoke["exact_match"] is None and smoke["n"] == 0 and smoke["skipped"] == [NO_TEST], smoke
    assert f"smoke test: {NO_TEST}" in (workdir / layout.log_file("smoke_test", RUN)).read_text()
    assert f"Skipped: {NO_TEST}." in tree.overview_html.read_text()
    assert NO_TEST in tree.summary_html.read_text()


def test_the_verification_names_each_base_and_measures_the_quantized_one(nf4_run):
    workdir, _ = nf4_run
    report = json.loads((workdir / "results" / RUN / "export" / layout.VERIFICATION_FILE).read_text())
    assert report["passed"] and report["max_abs_diff"] <= report["tolerance"]
    assert "unquantized, from its files" in report["reference"]
    quantized = report["quantized_reference"]
    assert "model.quantization=nf4" in quantized["reference"] and quantized["gated"] is False
    # The merged model is as far from what trained as 4-bit quantization moves the base itself: the
    # same order, and far above the float comparison's rounding.
    assert 0 < quantized["base_quantization_error"] and quantized["max_abs_diff"] > 100 * report["max_abs_diff"]
    assert quantized["max_abs_diff"] < 10 * quantized["base_quantization_error"]


def test_the_merged_model_is_the_unquantized_base_plus_the_fp32_delta(nf4_run):
    """Stock `from_pretrained` of the merged dir against W + (alpha / r) B A computed here in fp32 from
    the base's own safetensors files and the exported adapter: max |difference| <= 1e-6."""
    from transformers import AutoModelForCausalLM

    workdir, _ = nf4_run
    export = workdir / "results" / RUN / "export"
    base_dir = workdir / "results" / "embedded" / "model"
    adapter_dir = next(export / name for name in (layout.ADAPTER_EMA, layout.ADAPTER_FINAL) if (export / name).is_dir())
    base = {k: v for f in sorted(base_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    adapter = load_file(str(adapter_dir / layout.PEFT_WEIGHTS))
    peft = json.loads((adapter_dir / layout.PEFT_CONFIG).read_text())
    scale = peft["lora_alpha"] / peft["r"]
    expected = {k: v.float() for k, v in base.items()}
    merged_targets = 0
    for key in adapter:
        if ".lora_A." not in key:
            continue
        target = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        b = adapter[key.replace(".lora_A.", ".lora_B.")].double()
        expected[target] = (base[target].double() + scale * (b @ adapter[key].double())).float()
        merged_targets += 1
    assert merged_targets >= 7  # every projection of at least one layer
    merged = AutoModelForCausalLM.from_pretrained(export / layout.MERGED, dtype=torch.float32).state_dict()
    worst = max(float((merged[k].float() - v).abs().max()) for k, v in expected.items())
    assert worst <= 1e-6, worst
    assert all(p.dtype == torch.float32 for p in merged.values())  # a float model: nothing of the 4-bit base
