"""Sweeps (config `sweep`): several runs as one DAG, shared data work, one comparison, pruning.

One cold sweep of the embedded default on a shorter schedule, on the session's
prepared embedded base, made once for this module; the tests that change it take
a copy. Its variants: config/sweep.yaml's grid narrowed to rank 8 (2 learning
rates) and one named variant beside it (sweep.variants), so one run has both
kinds; the user's whole 2 x 2 grid is planned by a dry run
(test_benchmarks_run_the_base_once_and_each_variant_once). A variant of
run `demo` lives in results/demo/variants/<name>/; results/demo/ keeps what they share (data, the
base model's evaluation) and the comparison (sweep/).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
import yaml
from kits.run import copy_run, copy_workflow, jobs_with_wildcards, seed_embedded_base, sha256, snakemake

pytestmark = pytest.mark.workflow

RUN = "results/demo"
# Short enough for CI (3 variants x 3 stages: pilot 0-6, chunk01 6-33, chunk02 33-60), long enough
# that the variants differ. No lm-eval benchmarks in the cold sweep (14 jobs that no comparison reads):
# how a sweep schedules them is shown by a dry run (test_benchmarks_run_the_base_once_and_each_variant_once).
SCHEDULE = {"schedule": {"total_updates": 60, "pilot_fraction": 0.1, "num_chunks": 2}}
SMALL = {**SCHEDULE, "evaluate": {"max_test": 16, "benchmarks": {"tasks": []}},
         "sweep": {"grid": {"lora.r": [8]}, "variants": {"lr-0.002_r-16": ["optim.lr=2e-3", "lora.r=16"]}}}
GRID = ["lr-0.001_r-8", "lr-0.002_r-8", "lr-0.002_r-16"]  # the cold sweep's variants: the grid's two, the named one
USER_GRID = ["lr-0.001_r-8", "lr-0.001_r-16", "lr-0.002_r-8", "lr-0.002_r-16"]  # config/sweep.yaml's 2 x 2
ADAPTER = "stages/chunk02/checkpoint/adapter/adapter_model.safetensors"


def _sweep(workdir: Path, *extra_configs: str, dry: bool = False) -> tuple[subprocess.CompletedProcess, list]:
    """snakemake --cores all on the sweep (targets: the default); returns the run and its jobs."""
    args = ["-n"] if dry else []
    proc = snakemake(workdir, *args, "--cores", "all", "--configfile", "config/sweep.yaml", "small.yaml",
                     *extra_configs, timeout=3000)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    return proc, jobs_with_wildcards(log)


def _vrun(name: str) -> str:
    return f"demo/variants/{name}"


@pytest.fixture(scope="module")
def sweep(embedded_base, tmp_path_factory):
    """The cold sweep on the prepared embedded base: (its directory, the jobs it ran)."""
    workdir = seed_embedded_base(copy_workflow(tmp_path_factory.mktemp("sweep")), embedded_base)
    (workdir / "small.yaml").write_text(yaml.safe_dump(SMALL))
    _, jobs = _sweep(workdir)
    return workdir, jobs


def test_one_command_runs_every_variant_on_data_prepared_once(sweep):
    workdir, jobs = sweep
    rules = Counter(rule for rule, _ in jobs)
    # Shared work once: the dataset check, tokenization, the base model's evaluation (the base itself:
    # the dry run of test_benchmarks_run_the_base_once_and_each_variant_once).
    for rule in ("validate_dataset", "tokenize_dataset", "evaluate_base", "plan_base", "sweep_compare"):
        assert rules[rule] == 1, (rule, rules)
    assert rules["prepare_base"] == 0, rules  # the session's prepared base was taken as done
    # Per variant: its plan, 3 stages and their evaluations, its exports.
    trained = Counter(w["vrun"] for rule, w in jobs if rule == "train_stage")
    assert trained == {_vrun(name): 3 for name in GRID}
    assert rules["merge_lora"] == rules["smoke_test"] == rules["plan"] == len(GRID)
    # No variant wrote over another: different final adapters, each in its own directory.
    adapters = {sha256(workdir / RUN / "variants" / name / ADAPTER) for name in GRID}
    assert len(adapters) == len(GRID)
    # Every variant trained with its own overrides.
    for name in GRID:
        cfg = yaml.safe_load((workdir / RUN / "variants" / name / "train_config.yaml").read_text())
        lr, r = name.split("_")
        assert cfg["optim"]["lr"] == float(lr.removeprefix("lr-")) and cfg["lora"]["r"] == int(r.removeprefix("r-"))


def test_comparison_names_the_best_variant_and_its_merged_model_loads_fresh(sweep):
    workdir, _ = sweep
    table = pd.read_csv(workdir / RUN / "sweep" / "comparison.csv")
    assert sorted(table["variant"]) == sorted(GRID)
    assert (table["stopped"] == "finished").all()
    for column in ("overrides", "val_raw", "val_ema_0.9", "val_ema_0.98", "best_val_raw", "best_val_ema_0.98",
                   "exact_match"):
        assert table[column].notna().all(), column
    assert (workdir / RUN / "sweep" / "loss.png").stat().st_size > 10_000
    best = json.loads((workdir / RUN / "sweep" / "best.json").read_text())
    assert best["best"] == table.loc[table["best_val"].idxmin(), "variant"]
    link = workdir / RUN / "sweep" / "best"
    assert link.is_symlink() and link.resolve() == (workdir / RUN / "variants" / best["best"]).resolve()
    html = (workdir / RUN / "sweep" / "comparison.html").read_text()
    assert f"{best['best']} (best)" in html
    # The best variant's merged model, through the fixed path, in a process of its own.
    merged = link / "export" / "merged"
    code = ("import sys, torch, transformers as t; m = t.AutoModelForCausalLM.from_pretrained(sys.argv[1]); "
            "tok = t.AutoTokenizer.from_pretrained(sys.argv[1]); ids = tok('repeat: abc', return_tensors='pt'); "
            "out = m.generate(**ids, max_new_tokens=4, do_sample=False); print(out.shape[1] > ids['input_ids'].shape[1])")
    loaded = subprocess.run([sys.executable, "-c", code, str(merged)], capture_output=True, text=True, cwd=workdir)
    assert loaded.returncode == 0 and loaded.stdout.strip() == "True", loaded.stderr[-3000:]


def test_benchmarks_run_the_base_once_and_each_variant_once(tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    (workdir / "small.yaml").write_text(yaml.safe_dump(SCHEDULE))  # the default benchmarks: [embedded]
    _, planned = _sweep(workdir, dry=True)
    rules = Counter(rule for rule, _ in planned)
    assert rules["prepare_base"] == 1, rules
    assert rules["benchmark_base"] == rules["demo_benchmark"] == 1, rules  # the base model's, shared
    runs = Counter(w["vrun"] for rule, w in planned if rule == "benchmark")
    assert runs == {_vrun(name): 1 for name in USER_GRID}, runs
    for rule in ("benchmark_report", "benchmark_card"):
        assert sorted(w["vrun"] for r, w in planned if r == rule) == sorted(map(_vrun, USER_GRID)), rule


def test_report_holds_the_comparison(sweep, tmp_path):
    workdir, _ = sweep
    work = copy_run(workdir, tmp_path / "wf")
    proc = snakemake(work, "--configfile", "config/sweep.yaml", "small.yaml", "--report", "report.zip")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    with zipfile.ZipFile(work / "report.zip") as archive:
        names = [Path(n).name for n in archive.namelist()]
        page = archive.read("report/report.html").decode()
    assert names.count("comparison.csv") == names.count("comparison.html") == 1, names
    assert names.count("loss.png") == len(GRID) + 1  # each variant's and the sweep's
    assert "Sweep" in page and all(_vrun(name) in page for name in GRID)  # the category, a subcategory per variant


def test_adding_a_variant_plans_only_its_jobs(sweep, tmp_path):
    work = copy_run(sweep[0], tmp_path / "wf")
    (work / "more.yaml").write_text(yaml.safe_dump({"sweep": {"variants": {"lr-5e-4": ["optim.lr=5e-4"]}}}))
    _, planned = _sweep(work, "more.yaml", dry=True)
    others = [(rule, w) for rule, w in planned if w.get("vrun") != _vrun("lr-5e-4")]
    assert [rule for rule, _ in others] == ["sweep_compare"], others
    assert Counter(w.get("stage") for rule, w in planned if rule == "train_stage") == \
        {"pilot": 1, "chunk01": 1, "chunk02": 1}


def test_a_deleted_chunk_retrains_only_that_variants_later_stages(sweep, tmp_path):
    work = copy_run(sweep[0], tmp_path / "wf")
    name = "lr-0.002_r-8"
    before = {n: sha256(work / RUN / "variants" / n / ADAPTER) for n in GRID}
    shutil.rmtree(work / RUN / "variants" / name / "stages" / "chunk01")
    _, planned = _sweep(work, dry=True)
    assert {w.get("vrun") for rule, w in planned if rule != "sweep_compare"} == {_vrun(name)}
    assert [w["stage"] for rule, w in planned if rule == "train_stage"] == ["chunk01", "chunk02"]
    _, ran = _sweep(work)
    assert [w["stage"] for rule, w in ran if rule == "train_stage"] == ["chunk01", "chunk02"]
    after = {n: sha256(work / RUN / "variants" / n / ADAPTER) for n in GRID}
    assert after == before  # and the retrained variant computed exactly what it had before


def test_removing_a_variant_leaves_its_outputs_and_the_others_untouched(sweep, tmp_path):
    work = copy_run(sweep[0], tmp_path / "wf")
    (work / "fewer.yaml").write_text(yaml.safe_dump({"sweep": {"grid": {"optim.lr": [1.0e-3], "lora.r": [8]}}}))
    before = {n: sha256(work / RUN / "variants" / n / ADAPTER) for n in GRID}
    _, ran = _sweep(work, "fewer.yaml")
    assert [rule for rule, _ in ran] == ["sweep_compare"]
    assert {n: sha256(work / RUN / "variants" / n / ADAPTER) for n in GRID} == before
    table = pd.read_csv(work / RUN / "sweep" / "comparison.csv")
    assert sorted(table["variant"]) == ["lr-0.001_r-8", "lr-0.002_r-16"]  # lr-0.002_r-8 left the grid


def _keep_only_pilots(work: Path) -> None:
    """Back to the moment every variant has finished its pilot (and its evaluation and gate)."""
    for name in GRID:
        root = work / RUN / "variants" / name
        for path in [*(root / "stages").iterdir(), *(root / "eval").iterdir(), root / "export", root / "report"]:
            if path.name not in ("pilot", "pilot.json"):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    shutil.rmtree(work / RUN / "sweep")
    shutil.rmtree(work / "work", ignore_errors=True)


def test_pruning_at_the_pilot_trains_only_the_best_and_raising_k_brings_back_the_second(sweep, tmp_path):
    work = copy_run(sweep[0], tmp_path / "wf")
    _keep_only_pilots(work)
    pilot = {n: json.loads((work / RUN / "variants" / n / "eval" / "pilot.json").read_text()) for n in GRID}
    ranking = sorted(GRID, key=lambda n: min(r["loss"] for r in pilot[n]["rows"]))
    (work / "prune1.yaml").write_text(yaml.safe_dump({"sweep": {"prune": {"at": ["pilot"], "keep": 1}}}))
    _, ran = _sweep(work, "prune1.yaml")
    trained = Counter(w["vrun"] for rule, w in ran if rule == "train_stage")
    assert trained == {_vrun(ranking[0]): 2}  # chunk01 and chunk02
    decision = json.loads((work / RUN / "sweep" / "prune" / "pilot.json").read_text())
    assert decision["kept"] == ranking[:1] and sorted(decision["stopped"]) == sorted(ranking[1:])
    table = pd.read_csv(work / RUN / "sweep" / "comparison.csv").set_index("variant")
    for name in ranking[1:]:
        assert table.loc[name, "stopped"].startswith("pruned after pilot: rank") and table.loc[name, "last_stage"] == "pilot"
        assert not (work / RUN / "variants" / name / "stages" / "chunk01").exists()
    assert table.loc[ranking[0], "stopped"] == "finished"
    html = (work / RUN / "sweep" / "comparison.html").read_text()
    assert "Stopped early" in html and all(name in html for name in ranking[1:])
    # A larger k: only the second variant's remaining stages train; the pruned third keeps its pilot.
    (work / "prune2.yaml").write_text(yaml.safe_dump({"sweep": {"prune": {"at": ["pilot"], "keep": 2}}}))
    _, ran = _sweep(work, "prune2.yaml")
    assert [(w["vrun"], w["stage"]) for rule, w in ran if rule == "train_stage"] == \
        [(_vrun(ranking[1]), s) for s in ("chunk01", "chunk02")]
    table = pd.read_csv(work / RUN / "sweep" / "comparison.csv").set_index("variant")
    assert table.loc[ranking[1], "stopped"] == "finished" and table.loc[ranking[2], "last_stage"] == "pilot"
    # Exactly what it had computed in the unpruned sweep.
    assert sha256(work / RUN / "variants" / ranking[1] / ADAPTER) == \
        sha256(sweep[0] / RUN / "variants" / ranking[1] / ADAPTER)
