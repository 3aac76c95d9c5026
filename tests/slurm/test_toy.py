"""Toy workflows through snakemake-executor-plugin-slurm on the local SLURM.

These check the test cluster and the test profile (tests/slurm/profile), not
the pipeline: every rule job must become a SLURM job, finish, and be seen
finished by the plugin's squeue-based status polling.
"""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

TOY_SNAKEFILE = textwrap.dedent(
    """
    rule all:
        input: "c.txt"

    rule a:
        output: "a.txt"
        resources: cpus_per_task=1, mem_mb=500, runtime=5
        shell: "sleep 2; echo a job=$SLURM_JOB_ID cpus=$SLURM_CPUS_PER_TASK > {output}"

    rule b:
        input: "a.txt"
        output: "b.txt"
        shell: "cat {input} > {output}; echo b job=$SLURM_JOB_ID >> {output}"

    rule c:
        input: "b.txt"
        output: "c.txt"
        shell: "cat {input} > {output}; echo c job=$SLURM_JOB_ID >> {output}"
    """
)

# Generous bound: ~12 s per job on an idle 2-core machine (see profile), plus
# start-up; a regression in the status-check settings shows up as minutes.
TOY_MAX_SECONDS = float(os.environ.get("SLURM_TOY_MAX_SECONDS", "150"))


def _slurm_logs(workdir: Path, rule: str) -> list[Path]:
    return sorted((workdir / ".snakemake" / "slurm_logs" / f"rule_{rule}").glob("*.log"))


def test_toy_workflow_runs_through_slurm(slurm_cluster, tmp_path):
    (tmp_path / "Snakefile").write_text(TOY_SNAKEFILE)

    run = slurm_cluster.snakemake(tmp_path, timeout=600).check()
    print(f"toy workflow (3 SLURM jobs) took {run.seconds:.1f}s end to end")

    text = (tmp_path / "c.txt").read_text()
    job_ids = {}
    for rule in ("a", "b", "c"):
        m = re.search(rf"^{rule} job=(\d+)", text, re.M)
        assert m, f"rule {rule} did not run inside a SLURM job:\n{text}"
        job_ids[rule] = m.group(1)
    assert len(set(job_ids.values())) == 3, job_ids
    assert "cpus=1" in text, text

    # The plugin wrote one SLURM log per job, named after the SLURM job id.
    for rule, jid in job_ids.items():
        logs = _slurm_logs(tmp_path, rule)
        assert [p.name for p in logs] == [f"{jid}.log"], (rule, logs)
        assert f"rule {rule}:" in logs[0].read_text()

    # slurmctld remembers them (MinJobAge) as COMPLETED under the run's name.
    states = {
        line.split("|")[0]: line.split("|")[1]
        for line in slurm_cluster.squeue().splitlines()
        if line
    }
    for rule, jid in job_ids.items():
        assert states.get(jid) == "COMPLETED", (rule, jid, states)

    # The 'all' rule is local; the other three were submitted.
    assert run.stdout.count("has been submitted with SLURM jobid") == 3, run.stdout
    assert run.seconds < TOY_MAX_SECONDS, f"too slow: {run.seconds:.1f}s"


RETRY_SNAKEFILE = textwrap.dedent(
    """
    rule flaky:
        output: "flaky.txt"
        resources:
            runtime=5,
            mem_mb=500,
            att=lambda wildcards, attempt: attempt,
        shell:
            "echo attempt={resources.att} job=$SLURM_JOB_ID >> attempts.log; "
            "test {resources.att} -ge 2; "
            "echo ok > {output}"
    """
)


def test_failed_job_is_resubmitted_with_next_attempt(slurm_cluster, tmp_path):
    (tmp_path / "Snakefile").write_text(RETRY_SNAKEFILE)

    run = slurm_cluster.snakemake(tmp_path, "--retries", "1", timeout=600).check()
    print(f"fail + retry took {run.seconds:.1f}s end to end")

    lines = (tmp_path / "attempts.log").read_text().split()
    attempts = [x for x in lines if x.startswith("attempt=")]
    jobs = [x for x in lines if x.startswith("job=")]
    assert attempts == ["attempt=1", "attempt=2"], lines
    assert len(set(jobs)) == 2 and all(j != "job=" for j in jobs), lines
    assert (tmp_path / "flaky.txt").read_text().strip() == "ok"
    # squeue knows only FAILED/COMPLETED, so the plugin cannot give a reason.
    assert "SLURM status is: 'FAILED'" in run.stdout, run.stdout


GPU_SNAKEFILE = textwrap.dedent(
    """
    rule gpu_job:
        output: "gpu.txt"
        resources: gpu=1, cpus_per_task=1, mem_mb=500, runtime=5
        shell: "echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES > {output}"
    """
)


def test_gpu_request_matches_cluster_gpus(slurm_cluster, tmp_path):
    """gpu=1 becomes sbatch --gpus=1: rejected without GRES, placed with fake GPUs."""
    (tmp_path / "Snakefile").write_text(GPU_SNAKEFILE)

    run = slurm_cluster.snakemake(tmp_path, "--retries", "0", "--verbose", timeout=300)

    assert "--gpus=1" in run.stdout, run.stdout
    if slurm_cluster.fake_gpus:
        run.check()
        # One device of the node's; which one depends on what else holds a GPU at the time.
        seen = (tmp_path / "gpu.txt").read_text().split()[0]
        assert seen in {f"CUDA_VISIBLE_DEVICES={i}" for i in range(slurm_cluster.fake_gpus)}, seen
    else:
        assert run.returncode != 0, run.stdout
        assert "Invalid generic resource (gres) specification" in run.stdout, run.stdout
        assert not (tmp_path / "gpu.txt").exists()
