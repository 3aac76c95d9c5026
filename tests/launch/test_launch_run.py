"""`python -m pipeline.launch`: output to the log, the reason for a failure on the terminal, exit codes,
and signals that reach every process of the command."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kits.train import make_run, pipeline_env, resolved_config

from pipeline import layout


def launch(tmp_path, *args, cmd, env=None, **kw) -> subprocess.CompletedProcess:
    log = tmp_path / "logs" / "rule.log"
    full = [sys.executable, "-m", "pipeline.launch", "--log", str(log), *args, "--", *cmd]
    return subprocess.run(full, capture_output=True, text=True, env=pipeline_env(env), timeout=300, **kw)


def test_output_goes_to_the_log_and_success_is_quiet(tmp_path):
    proc = launch(tmp_path, cmd=[sys.executable, "-c", "print('hello'); import sys; print('warn', file=sys.stderr)"])
    assert proc.returncode == 0 and proc.stderr == "" and proc.stdout == ""
    first, *printed = (tmp_path / "logs/rule.log").read_text().splitlines()
    assert first.startswith("pipeline.launch: ") and " -c " in first  # the command it ran, shell-quoted
    assert printed == ["hello", "warn"]


def test_a_user_error_is_shown_on_the_terminal_with_the_log_path_and_its_exit_code(tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": ""}]}\n')
    proc = launch(tmp_path, cmd=[sys.executable, "-m", "pipeline", "plan", "--total-updates", "10",
                                 "--pilot-fraction", "2.0", "--num-chunks", "1",
                                 *resolved_config(["model.path=/m", "tokens.train_cache=/t"]), "--export-weights", "raw",
                                 "--out-plan", str(tmp_path / "p.json"), "--out-config", str(tmp_path / "c.yaml")],
                  cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 2
    first = proc.stderr.splitlines()[0]
    assert first == "pipeline: plan failed (exit 2):", proc.stderr
    assert "schedule.pilot_fraction=2.0 must be in (0, 1)" in proc.stderr
    assert f"full log: {tmp_path / 'logs/rule.log'}" in proc.stderr
    assert "Traceback" not in proc.stderr
    log = (tmp_path / "logs/rule.log").read_text()
    assert log.rstrip().endswith(f"full log: {tmp_path / 'logs/rule.log'}")  # the summary closes the log too


def test_a_crash_shows_its_exception_not_the_traceback(tmp_path):
    proc = launch(tmp_path, cmd=[sys.executable, "-c", "import json; json.loads('{')"])
    assert proc.returncode == 1
    assert "JSONDecodeError: Expecting property name" in proc.stderr and "Traceback" not in proc.stderr
    assert "Traceback" in (tmp_path / "logs/rule.log").read_text()


def _terminate_training(run, log, nproc: int) -> tuple[int, str]:
    """Start a stage through the launcher, send the launcher SIGTERM after its first update."""
    args = ["--plan", run.plan, "--config", run.config, "--stage", "all", "--scratch", run.scratch("all"),
            "--out", run.stage_dir("all")]
    cmd = [sys.executable, "-m", "pipeline.launch", "--log", str(log), "--train", "--nproc", str(nproc), "--",
           "-m", "pipeline", "train", *map(str, args)]
    proc = subprocess.Popen(cmd, env=pipeline_env({"SFT_FAULTS": json.dumps({"sleep_per_step": 0.2})}),
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while time.time() < deadline and not (run.scratch("all") / "metrics.jsonl").is_file():
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)  # what snakemake does to a job it stops
    _, err = proc.communicate(timeout=180)
    return proc.returncode, err


def test_sigterm_to_the_launcher_makes_a_training_stage_save_and_exit_75(tiny, tmp_path):
    run = make_run(tmp_path / "run", tiny, total=12, fraction=0.5, chunks=1, single_stage=True)
    code, err = _terminate_training(run, tmp_path / "train.log", nproc=1)
    assert code == layout.EXIT_PREEMPTED, err
    assert "preempted at update" in err
    latest = (run.scratch("all") / layout.LATEST_FILE).read_text().strip()
    assert (run.scratch("all") / latest / layout.MANIFEST_FILE).is_file()


@pytest.mark.distributed
def test_sigterm_reaches_every_torchrun_rank_which_save_together(tiny, tmp_path):
    run = make_run(tmp_path / "run", tiny, total=12, fraction=0.5, chunks=1, single_stage=True)
    log = tmp_path / "train.log"
    code, err = _terminate_training(run, log, nproc=2)
    assert code == layout.EXIT_PREEMPTED, err + log.read_text()[-3000:]
    saved = run.scratch("all") / (run.scratch("all") / layout.LATEST_FILE).read_text().strip()
    state = saved / layout.TRAINING_STATE_DIR
    assert (state / "rng_rank000.json").is_file() and (state / "rng_rank001.json").is_file()  # both ranks saved


@pytest.mark.parametrize("user", [None, "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_a_training_job_gets_expandable_segments_unless_the_user_configured_the_allocator(tmp_path, monkeypatch, user):
    from pipeline.launch import __main__ as launcher

    for name in launcher.ALLOC_CONF_NAMES:
        monkeypatch.delenv(name, raising=False)
    if user:
        monkeypatch.setenv(user, "max_split_size_mb:128")
    started = {}
    monkeypatch.setattr(launcher.run, "run", lambda cmds, log, env, preemptible: started.update(env) or 0)
    for train in ([], ["--train"]):
        started.clear()
        assert launcher.main(["--log", str(tmp_path / "log"), *train, "--", "-m", "pipeline", "train"]) == 0
        expected = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if train and not user else {}
        assert {k: v for k, v in started.items() if k in launcher.ALLOC_CONF_NAMES} == (
            expected or ({user: "max_split_size_mb:128"} if user else {}))
