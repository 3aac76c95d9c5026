"""The trainer config is cached by meaning: comments and unused groups retrain nothing, a changed
value retrains every stage (once the user asked for it: on_config_change), and a config whose two
layers disagree stops before any job."""

from __future__ import annotations

import pytest
from kits.run import copy_run, jobs_in_log

pytestmark = pytest.mark.workflow


def _planned(proc) -> list[tuple[str, str | None]]:
    return jobs_in_log(proc.stdout + proc.stderr)  # snakemake lists jobs on stderr


def test_comments_and_unused_groups_retrain_nothing_a_changed_value_retrains_all(done, run_snakemake, tmp_path):
    run = copy_run(done, tmp_path / "run")
    with open(run / "config/train/optim/adamw.yaml", "a") as f:
        f.write("# a comment the resolved config does not see\n")
    full = run / "config/train/lora/full.yaml"  # the run trains LoRA: this group is not used
    full.write_text(full.read_text() + "dropout: 0.3  # a value, edited\n")
    dry = run_snakemake(run, "-n", "--cores", "all")
    assert dry.returncode == 0 and "Nothing to be done" in dry.stdout + dry.stderr, (dry.stdout + dry.stderr)[-3000:]

    config = run / "config/config.yaml"
    config.write_text(config.read_text().replace("optim.lr=2e-3", "optim.lr=1e-3"))
    # A finished run is retrained only when asked (else the workflow stops: test_config_guard.py).
    dry = run_snakemake(run, "-n", "--cores", "all", "--config", "on_config_change=archive")
    trained = sorted(stage for rule, stage in _planned(dry) if rule == "train_stage")
    assert trained == ["chunk01", "chunk02", "pilot", "tail"], (dry.stdout + dry.stderr)[-3000:]


def test_the_plan_is_keyed_on_the_resolved_config_not_on_how_it_is_written_or_what_is_exported(
        done, run_snakemake, tmp_path):
    """The same lr written another way, the overrides in another order, and another exported EMA rate
    (one the trainer keeps): nothing is planned or trained again; the export follows the new rate."""
    run = copy_run(done, tmp_path / "run")
    config = run / "config/config.yaml"
    text = config.read_text().replace("optim.lr=2e-3", "optim.lr=0.002").replace("ema_rate: 0.98", "ema_rate: 0.9")
    text = text.replace("    - optim.global_batch=32\n    - optim.micro_batch=16\n",
                        "    - optim.micro_batch=16\n    - optim.global_batch=32\n")
    config.write_text(text)
    dry = run_snakemake(run, "-n", "--cores", "all")
    rules = {rule for rule, _ in _planned(dry)}
    assert dry.returncode == 0 and "consolidate" in rules, (dry.stdout + dry.stderr)[-3000:]
    assert not rules & {"plan", "train_stage", "evaluate_stage"}, sorted(rules)


def test_export_rate_the_trainer_does_not_keep_stops_snakemake_before_any_job(done, run_snakemake, tmp_path):
    run = copy_run(done, tmp_path / "run")
    config = run / "config/config.yaml"
    config.write_text(config.read_text().replace("ema_rate: 0.98", "ema_rate: 0.5"))
    for args in (["-n"], []):
        proc = run_snakemake(run, *args, "--cores", "all")
        err = proc.stdout + proc.stderr  # the terminal (snakemake prints load-time errors on stdout)
        assert proc.returncode != 0
        assert "export.ema_rate=0.5" in err and "ema.rates=[0.9, 0.98]" in err, err[-3000:]
        assert _planned(proc) == []  # refused when the workflow loads: no job, no training
