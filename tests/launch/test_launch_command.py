"""The start of every rule's shell command (`pipeline.launch.command.shell_prefix`), as Snakemake formats it."""

from __future__ import annotations

import shlex

from pipeline.launch.command import shell_prefix


def test_a_plain_job_and_a_training_stage():
    assert shell_prefix({"kind": "none"}) == "exec python -m pipeline.launch --log {log} --gpus 0 -- "
    assert shell_prefix(None, gpus="all", train={"nodes": 2, "nproc": "auto"}) == (
        "exec python -m pipeline.launch --log {log} --gpus all --train --nodes 2 --nproc auto -- ")
    train = {"nodes": 2, "nproc": 1, "rdzv_timeout_s": 60, "rdzv_port": 29400, "socket_ifname": "ib0", "x": 1}
    assert shell_prefix(None, gpus=1, train=train) == (
        "exec python -m pipeline.launch --log {log} --gpus 1 --train --nodes 2 --nproc 1 --rdzv-timeout 60 "
        "--rdzv-port 29400 --socket-ifname ib0 -- ")


def test_the_tracker_settings_reach_the_shell_quoted_and_braces_intact():
    prefix = shell_prefix({"kind": "mlflow", "uri": "http://h:5000", "tags": {"team": "{nlp}"}, "run_name": "a b"})
    # Snakemake fills in {log} and turns {{ }} back into braces: what the shell then reads
    shell = prefix.replace("{log}", "logs/x.log").replace("{{", "{").replace("}}", "}")
    words = shlex.split(shell)
    assert "PIPELINE_TRACKER_KIND=mlflow;" in words and "PIPELINE_TRACKER_RUN_NAME=a b;" in words
    assert "PIPELINE_TRACKER_TAGS=team={nlp};" in words
    assert words[-9:] == ["exec", "python", "-m", "pipeline.launch", "--log", "logs/x.log", "--gpus", "0", "--"]
