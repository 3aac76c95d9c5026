"""The default pipeline on the real local SLURM of two nodes (tests/slurm/cluster.sh), as users run it.

The session's run trains with `train.nodes: 2`: every training stage is one 2-node SLURM job (one
torchrun agent per node under srun, c10d rendezvous on the first node, gloo between the nodes'
addresses); evaluation and export run as usual.

- the whole DAG through `snakemake --profile <test profile>` gives the local 1-process run's
  adapter, EMA shadows and optimizer state, stage by stage; a 2-rank pilot on one node gives them too;
- each training stage's log has one start line per node: its hostname, address and node rank;
- in that run, what slurmctld got for each job: the test profile's partition and account for
  the training stages and the stages' evaluation, the workflow's `slurm` settings for the other
  jobs of their kind, the profile's default-resources for what neither sets, two nodes with a GPU
  each for training, and the GPUs of `evaluate.gpus` for evaluation, verification and the smoke test;
- a 2-node training job that gets SIGUSR1 mid-stage saves once, fails, is resubmitted by
  `--retries`, resumes from its checkpoint and ends with the same adapter;
- a node whose training processes are killed mid-stage: the job fails within the collective
  timeout, the terminal names that node, and the retry resumes and ends with the same adapter;
- a failure injected in chunk02 leaves pilot and chunk01 alone, and a plain
  `snakemake --cores all` afterwards runs exactly chunk02 and what follows; that chunk02
  job's `--set-resources` changes the keys it names and keeps the rule's own runtime and GPUs;
- the example cluster profile, installed as the user's `slurm` profile as its
  README says, asks SLURM for GPUs for the training and evaluation rules.

The cluster has two (fake) GPUs per node, so the rules' `gpu=1` requests are honoured; the
machine has 2 CPUs, so the test profile's set-resources cap the rules' CPU and memory
requests to one CPU per job (per node): a stage's evaluation runs beside the next stage's training,
as `snakemake --cores all` does locally.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from kits.run import FINAL_ADAPTER, copy_workflow, jobs_in_log, sha256, snakemake
from kits.slurm import COLLECTIVE_TIMEOUT_S, RDZV_TIMEOUT_S, slurm_workdir

pytestmark = pytest.mark.slurm

RUN = "results/demo"
VRUN = "demo"  # the {vrun} wildcard of a run without a sweep: the run itself
# What one job gets on the test node (2 CPUs, ~22 GB; tests/slurm/cluster.sh): two jobs at once
# (the test profile's set-resources).
JOB_CPUS, JOB_MEM_MB = 1, 6000


def _submitted(record: Path) -> dict[str, list[dict[str, str]]]:
    """rule -> what slurmctld recorded for each of its jobs (`scontrol show job -o` fields),
    from the file `record_sbatch` fills."""
    jobs: dict[str, list[dict[str, str]]] = {}
    for line in record.read_text().splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        rule = re.match(r"rule_(\w+?)(?:_wildcards_|$)", fields["Comment"]).group(1)
        jobs.setdefault(rule, []).append(fields)
    return jobs


def _nodes(job: dict[str, str]) -> str:
    """A job's node count (`NumNodes=2-2` while it pends, 2 once it runs)."""
    return job["NumNodes"].partition("-")[0]


def _job_wildcards(stage: str) -> str:
    """How the plugin writes a training job's wildcards (vrun, stage) in its log dir and comment."""
    return f"{VRUN}_{stage}"


def _stage_logs(workdir: Path, stage: str) -> list[Path]:
    """The plugin's per-job logs of one training stage, oldest job first."""
    logs = (workdir / ".snakemake/slurm_logs/rule_train_stage" / _job_wildcards(stage)).glob("*.log")
    return sorted(logs, key=lambda p: int(p.stem))


def _mtimes(workdir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in (workdir / RUN / "stages").iterdir()}


@pytest.fixture(scope="module")
def slurm_run(slurm_cluster, tmp_path_factory) -> tuple[Path, object]:
    """A cold run of the whole default pipeline through the test SLURM profile."""
    if slurm_cluster.fake_gpus < 1:
        pytest.fail("the pipeline's rules ask for gpu=1: start the test cluster with SLURM_TEST_FAKE_GPUS=1")
    workdir = slurm_workdir(tmp_path_factory.mktemp("slurm-run"))
    env, _ = slurm_cluster.record_sbatch(workdir)  # -> workdir/sbatch_jobs.txt
    run = slurm_cluster.snakemake(workdir, "--workflow-profile", "profiles/default", timeout=1500, env=env)
    print(f"default pipeline through SLURM: {run.seconds:.0f} s")
    slurm_cluster.check_no_job_left(workdir)
    return workdir, run


def _digests(checkpoint: Path) -> dict[str, str]:
    """sha256 of a stage checkpoint's adapter, EMA shadows and optimizer state (not the per-rank RNG:
    one file per rank)."""
    files = sorted(f for f in checkpoint.rglob("*.safetensors") if not f.name.startswith("rng_rank"))
    assert {"adapter", "ema", "training_state"} <= {f.relative_to(checkpoint).parts[0] for f in files}, files
    return {str(f.relative_to(checkpoint)): sha256(f) for f in files}


def _stage_digests(workdir: Path, stage: str) -> dict[str, str]:
    return _digests(workdir / RUN / "stages" / stage / "checkpoint")


def test_default_pipeline_on_two_nodes_equals_the_local_one_process_run(slurm_run, local_default_run):
    workdir, run = slurm_run
    run.check()
    # Every job but the local rules ran as a SLURM job, each training stage as one job on two nodes.
    plan = json.loads((workdir / RUN / "plan.json").read_text())
    for stage in plan["stages"]:
        logs = _stage_logs(workdir, stage["name"])
        assert len(logs) == 1, (stage["name"], logs)
        assert "rule train_stage" in logs[0].read_text()
    assert {_nodes(job) for job in _submitted(workdir / "sbatch_jobs.txt")["train_stage"]} == {"2"}
    for rule in ("prepare_base", "validate_dataset", "tokenize_dataset", "consolidate", "merge_lora", "verify_merge"):
        # under a directory named after the job's wildcards, when it has any
        assert list((workdir / ".snakemake/slurm_logs" / f"rule_{rule}").rglob("*.log")), rule
    # ... and computed what the local run (one process) computed, bit for bit: the adapter, every
    # EMA shadow and the optimizer state after every stage.
    for stage in plan["stages"]:
        assert _stage_digests(workdir, stage["name"]) == _stage_digests(local_default_run, stage["name"]), stage
    assert sha256(workdir / FINAL_ADAPTER) == sha256(local_default_run / FINAL_ADAPTER)
    for name in ("adapter_final", "adapter_ema", "adapter_best", "adapter_best_ema"):
        rel = f"{RUN}/export/{name}/adapter_model.safetensors"
        assert sha256(workdir / rel) == sha256(local_default_run / rel), rel
    assert json.loads((workdir / RUN / "export/verification.json").read_text())["passed"] is True


_NODE_LINE = re.compile(r"node rank (\d) of 2: host (\S+), address (\S+), local ranks 0-0 \(ranks \d-\d\), "
                        r"rendezvous (\S+)")


def test_each_training_stage_logs_one_line_per_node(slurm_run, slurm_cluster):
    """At the start of every training stage each node says where it runs: its hostname, its
    address, its node rank, and the rendezvous it met the other at (on the first node)."""
    workdir, run = slurm_run
    run.check()
    first, *_ = slurm_cluster.nodes
    for stage in ("pilot", "chunk01", "chunk02", "tail"):
        log = (workdir / f"logs/train_stage/demo/{stage}.log").read_text()
        lines = _NODE_LINE.findall(log)
        assert sorted((host, address) for _, host, address, _ in lines) == sorted(slurm_cluster.nodes.items()), lines
        assert sorted(rank for rank, *_ in lines) == ["0", "1"], lines
        assert {endpoint.rpartition(":")[0] for *_, endpoint in lines} == {first}, lines


def test_partition_account_gpus_and_runtime_reach_each_job(slurm_run, slurm_cluster):
    """Highest first: the profile's set-resources (training, a stage's evaluation), the workflow's
    `slurm` settings and derived resources, the profile's default-resources (partition debug,
    runtime 10 minutes, no account)."""
    workdir, run = slurm_run
    run.check()
    jobs = _submitted(workdir / "sbatch_jobs.txt")
    gpu = slurm_cluster.second_partition

    def seen(rule: str) -> set[tuple[str, str, str, str]]:
        return {(j["Partition"], j["Account"], j["TimeLimit"], j.get("TresPerJob", "")) for j in jobs[rule]}

    assert len(jobs["train_stage"]) == 4 and len(jobs["evaluate_stage"]) == 4, jobs.keys()
    # the profile's partition and account; the rule's runtime (240 min); two nodes, a GPU on each
    assert {(j["Partition"], j["Account"], j["TimeLimit"], _nodes(j), j.get("TresPerNode", ""))
            for j in jobs["train_stage"]} == {(gpu, "acct_train", "04:00:00", "2", "gres:gpu:1")}
    # the profile's account wins over the workflow's slurm.evaluate.account
    assert seen("evaluate_stage") == {(gpu, "acct_eval", "01:00:00", "gres:gpu:1")}
    for rule in ("evaluate_base", "verify_merge", "smoke_test"):  # evaluate.gpus: 1
        assert seen(rule) == {(gpu, "acct_workflow", "01:00:00", "gres:gpu:1")}, rule
    for rule in ("prepare_base", "prepare_tokenizer", "validate_dataset", "tokenize_dataset", "consolidate"):
        assert seen(rule) == {(slurm_cluster.partition, "acct_cpu", "00:10:00", "")}, rule
    assert seen("merge_lora") == {(slurm_cluster.partition, "acct_cpu", "02:00:00", "")}


def _running_job(slurm_cluster, comment: str, workdir: Path) -> str | None:
    """The running job of one rule (the plugin's comment) submitted from `workdir`, not another test's."""
    for line in slurm_cluster.jobs_from(workdir):
        job_id, state, job_comment = line.split("|")
        if state == "RUNNING" and job_comment.strip() == comment:
            return job_id.strip()
    return None


def _last_logged_step(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
    except FileNotFoundError:
        return -1
    steps = [json.loads(line).get("step", -1) for line in lines if line.strip().startswith("{")]
    return max(steps, default=-1)


def _chunk02_again(slurm_run, slurm_cluster, tmp_path, after: int, act) -> tuple[Path, dict, str, str, object]:
    """A copy of the session's run without chunk02 and tail, run again through SLURM; once chunk02's
    job has logged update `after`, `act(workdir, job_id)` hits it. Returns the workdir, chunk02's
    plan entry, the job hit, snakemake's output and what `act` returned."""
    source, _ = slurm_run
    workdir = slurm_workdir(tmp_path / "wf")
    # Start after chunk01: keep the prepared base, data, plan, pilot, gate and chunk01.
    shutil.copytree(source / "results", workdir / "results")
    for stage in ("chunk02", "tail"):
        shutil.rmtree(workdir / RUN / "stages" / stage)
    chunk = {s["name"]: s for s in json.loads((workdir / RUN / "plan.json").read_text())["stages"]}["chunk02"]
    proc = slurm_cluster.start_snakemake(workdir, "--workflow-profile", "profiles/default", f"{RUN}/stages/tail")
    job_id, acted, deadline = None, None, time.monotonic() + 900
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            job_id = job_id or _running_job(slurm_cluster, f"rule_train_stage_wildcards_{_job_wildcards('chunk02')}", workdir)
            if job_id and _last_logged_step(workdir / "work/demo/chunk02/metrics.jsonl") >= chunk["start"] + after:
                acted = act(workdir, job_id)
                break
            time.sleep(0.5)
        assert job_id is not None, "chunk02 never ran as a SLURM job"
        out, _ = proc.communicate(timeout=1200)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-6000:]
    # The job hit failed and was resubmitted once (--retries), which resumed and finished the run.
    logs = _stage_logs(workdir, "chunk02")
    assert len(logs) == 2 and logs[0].stem == job_id, (job_id, logs)
    return workdir, chunk, job_id, out, acted


def _resumed_at(workdir: Path) -> int:
    """The update the retry of chunk02 resumed from (its trainer log: the first attempt's is gone)."""
    trainer_log = (workdir / "logs/train_stage/demo/chunk02.log").read_text()
    m = re.search(r"start from \S*step_(\d+)", trainer_log)
    assert m, trainer_log[-3000:]
    return int(m.group(1))


def _saved(workdir: Path) -> list[int]:
    """The updates of chunk02's intra-stage checkpoints now in its scratch dir."""
    return sorted(int(p.name.removeprefix("step_")) for p in (workdir / "work/demo/chunk02").glob("step_*")
                  if p.name.removeprefix("step_").isdigit())


def _until_ended(slurm_cluster, job_id: str, limit_s: float) -> float:
    """Seconds until the job is no longer RUNNING (at most `limit_s`)."""
    t0 = time.monotonic()
    while slurm_cluster.job_state(job_id) == "RUNNING" and time.monotonic() - t0 < limit_s:
        time.sleep(0.2)
    return time.monotonic() - t0


def test_usr1_to_a_two_node_job_saves_once_resumes_and_ends_with_the_same_adapter(slurm_run, slurm_cluster,
                                                                                  local_default_run, tmp_path):
    """SLURM's preemption warning (what `--signal=USR1@<s>` sends) in the middle of chunk02: every
    process of the job's step, on both nodes, gets it; the ranks agree, save one checkpoint, exit 75."""
    # Past the stage's first intra-stage checkpoint (save_every=50), short of the next one:
    # resuming from the signal's checkpoint, not a periodic one, shows the save on USR1 worked.
    def preempt(workdir, job_id):
        signalled_at = _last_logged_step(workdir / "work/demo/chunk02/metrics.jsonl")
        subprocess.run(["scancel", "--signal=USR1", job_id], check=True)
        _until_ended(slurm_cluster, job_id, 300)
        return signalled_at, _saved(workdir)

    workdir, chunk, job_id, out, (signalled_at, saved) = _chunk02_again(slurm_run, slurm_cluster, tmp_path, 50,
                                                                        preempt)
    resumed_at = _resumed_at(workdir)
    assert chunk["start"] + 50 <= signalled_at <= resumed_at < chunk["end"] and resumed_at % 50, resumed_at
    # One save on the signal: not one per node, not one per signalled process.
    assert [step for step in saved if step >= signalled_at] == [resumed_at], (signalled_at, saved)
    assert "failed (exit 75)" in _stage_logs(workdir, "chunk02")[0].read_text()
    assert sha256(workdir / FINAL_ADAPTER) == sha256(local_default_run / FINAL_ADAPTER)


def test_a_node_killed_mid_chunk_fails_the_job_in_bounded_time_and_the_retry_resumes(slurm_run, slurm_cluster,
                                                                                    local_default_run, tmp_path):
    """The second node's training processes (its torchrun agent and rank) are killed 60 updates into
    chunk02. The job fails within the collective timeout plus a margin instead of hanging; the
    terminal names that node; the retry resumes from the last intra-stage checkpoint (every 50
    updates of the run) and the run ends with the 1-process run's adapter, EMA shadows and
    optimizer state."""
    _, lost = list(slurm_cluster.nodes)

    def kill_node(workdir, job_id):
        pids = slurm_cluster.node_processes(lost, workdir, "pipeline train")
        assert len(pids) >= 2, pids  # the agent and its rank
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        saved = _saved(workdir)
        return _until_ended(slurm_cluster, job_id, COLLECTIVE_TIMEOUT_S + 120), saved

    workdir, chunk, job_id, out, (took, saved) = _chunk02_again(slurm_run, slurm_cluster, tmp_path, 60, kill_node)
    print(f"job {job_id} ended {took:.1f} s after node {lost} was killed")
    assert took < COLLECTIVE_TIMEOUT_S + 30, took
    failed = _stage_logs(workdir, "chunk02")[0].read_text()
    assert f"on node {lost} (node rank " in failed, failed[-4000:]
    assert f"on node {lost} (node rank " in out, out[-6000:]  # on the terminal (show-failed-logs)
    assert saved and _resumed_at(workdir) == saved[-1] > chunk["start"], saved  # the last checkpoint
    for stage in ("chunk02", "tail"):
        assert _stage_digests(workdir, stage) == _stage_digests(local_default_run, stage), stage


def test_failed_chunk02_leaves_earlier_stages_and_reruns_only_what_follows(slurm_run, slurm_cluster,
                                                                           local_default_run, tmp_path):
    workdir, run = slurm_run
    run.check()
    plan = {s["name"]: s for s in json.loads((workdir / RUN / "plan.json").read_text())["stages"]}
    # chunk02 is rerun (-f) on SLURM with a fault injected 60 updates in, after its
    # first intra-stage checkpoint; no retries.
    fail_at = plan["chunk02"]["start"] + 60
    before = _mtimes(workdir)
    env, record = slurm_cluster.record_sbatch(tmp_path)
    # A --set-resources on the command line replaces the profile's whole set-resources (its
    # account for train_stage too), so the cap to the test node is repeated here.
    failed = slurm_cluster.snakemake(
        workdir, "--workflow-profile", "profiles/default", "--retries", "0", "-f", f"{RUN}/stages/chunk02",
        "--set-resources", f"train_stage:slurm_partition={slurm_cluster.partition}", f"train_stage:cpus_per_task={JOB_CPUS}",
        f"train_stage:mem_mb={JOB_MEM_MB}",
        env={**env, "SFT_FAULTS": json.dumps({"stage": "chunk02", "fail_at_step": fail_at})}, timeout=900,
    )
    assert failed.returncode != 0, failed.stdout[-4000:]
    slurm_cluster.check_no_job_left(workdir)
    # The partition it names; the rule's runtime and GPU stay (not the profile's default 10 minutes).
    [job] = _submitted(record)["train_stage"]
    assert (job["Partition"], job["Account"], job["TimeLimit"], _nodes(job), job["TresPerNode"]) == \
        (slurm_cluster.partition, "(null)", "04:00:00", "2", "gres:gpu:1"), job
    assert not (workdir / RUN / "stages/chunk02").exists()
    after_failure = _mtimes(workdir)
    for stage in ("pilot", "chunk01"):
        assert after_failure[stage] == before[stage], stage

    # The fault is gone; the user runs the pipeline again, locally this time (the two nodes' agents
    # on this machine).
    dry = snakemake(workdir, "-n", "--cores", "all")
    planned = jobs_in_log(dry.stdout + dry.stderr)
    assert {stage for rule, stage in planned if rule == "train_stage"} == {"chunk02", "tail"}, planned
    assert {stage for rule, stage in planned if rule == "evaluate_stage"} == {"chunk02", "tail"}, planned
    assert not any(rule in ("plan", "pilot_gate", "evaluate_base", "prepare_base", "tokenize_dataset")
                   for rule, _ in planned), planned
    rerun = snakemake(workdir, "--cores", "all")
    assert rerun.returncode == 0, rerun.stderr[-6000:]
    assert Counter(jobs_in_log(rerun.stderr + rerun.stdout)) == Counter(planned)  # the same jobs, any order

    after = _mtimes(workdir)
    for stage in ("pilot", "chunk01"):
        assert after[stage] == before[stage], stage
    trainer_log = (workdir / "logs/train_stage/demo/chunk02.log").read_text()
    m = re.search(r"start from \S*step_(\d+)", trainer_log)
    assert m and plan["chunk02"]["start"] < int(m.group(1)) <= fail_at, trainer_log[-3000:]
    assert sha256(workdir / FINAL_ADAPTER) == sha256(local_default_run / FINAL_ADAPTER)


def test_example_profile_installed_as_slurm_asks_gpus_for_training_and_evaluation(slurm_cluster, tmp_path):
    """README (profiles/slurm/README.md): link the profile as ~/.config/snakemake/slurm."""
    workdir = copy_workflow(tmp_path / "wf")
    config_home = tmp_path / "config"
    (config_home / "snakemake").mkdir(parents=True)
    (config_home / "snakemake/slurm").symlink_to(workdir / "profiles/slurm")
    dry = snakemake(workdir, "--profile", "slurm", "-n", env={"XDG_CONFIG_HOME": str(config_home)})
    log = dry.stdout + dry.stderr
    assert dry.returncode == 0, log[-4000:]
    assert "Using profiles slurm " in log, log[:2000]  # found via XDG_CONFIG_HOME (no ./slurm here)
    resources = {}
    for block in re.split(r"^(?=(?:local)?rule \w+:$)", log, flags=re.M):
        rule = re.match(r"(?:local)?rule (\w+):", block)
        res = re.search(r"^\s+resources: (.*)$", block, re.M)
        if rule and res:
            stage = re.search(r"^\s+wildcards: .*\bstage=(\w+)", block, re.M)
            resources[(rule.group(1), stage.group(1) if stage else None)] = res.group(1)
    train = {stage: res for (rule, stage), res in resources.items() if rule == "train_stage"}
    assert set(train) == {"pilot", "chunk01", "chunk02", "tail"}, resources
    for stage, res in train.items():
        assert re.search(r"\bgpu=1\b", res), (stage, res)
    for rule in ("evaluate_base", "smoke_test", "verify_merge"):  # evaluate.gpus: 1
        assert re.search(r"\bgpu=1\b", resources[(rule, None)]), rule
    assert not re.search(r"\bgpu=", resources[("tokenize_dataset", None)])


# --- multi-node as configuration (issue 14) ---------------------------------------------------------


def _two_rank_pilot(workdir: Path, done: Path) -> Path:
    """A copy of the workflow with the session run's base model, tokenizer and token caches (only plan and
    pilot run), training on 2 ranks of one node."""
    for rel in ("results/embedded", "results/demo/tokenizer", "results/demo/data"):
        shutil.copytree(done / rel, workdir / rel)
    (workdir / "ranks.yaml").write_text(yaml.safe_dump({"train": {"nodes": 1, "nproc": 2, "gpus_per_node": 2}}))
    return workdir


def test_a_two_rank_stage_on_one_node_equals_the_two_node_and_the_one_process_run(slurm_cluster, slurm_run,
                                                                                 local_default_run, tmp_path):
    """train.nodes=1, 2 ranks: under SLURM the launcher meets its ranks through a c10d rendezvous on the
    job's node (the multi-node path with one node); locally through --standalone. The pilot's adapter,
    EMA shadows and optimizer state equal the 2-node run's and the 1-process run's."""
    target = f"{RUN}/stages/pilot"
    on_slurm = _two_rank_pilot(slurm_workdir(tmp_path / "slurm"), local_default_run)
    run = slurm_cluster.snakemake(on_slurm, target, "--workflow-profile", "profiles/default",
                                  "--configfile", "ranks.yaml", timeout=900)
    run.check()
    local = _two_rank_pilot(copy_workflow(tmp_path / "local"), local_default_run)
    proc = snakemake(local, target, "--cores", "all", "--configfile", "ranks.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {rule for rule, _ in jobs_in_log(proc.stdout + proc.stderr)} == {"plan", "train_stage"}
    log = (on_slurm / "logs/train_stage/demo/pilot.log").read_text()
    assert "--rdzv-backend=c10d" in log and "--nproc-per-node=2" in log and "srun" not in log, log[:2000]
    assert "node rank 0 of 1: host " in log and "local ranks 0-1 (ranks 0-1)" in log, log[:3000]
    assert "--standalone" in (local / "logs/train_stage/demo/pilot.log").read_text()
    two_ranks = _stage_digests(on_slurm, "pilot")
    assert two_ranks == _stage_digests(local, "pilot")
    assert two_ranks == _stage_digests(slurm_run[0], "pilot")  # two nodes, one rank each
    assert two_ranks == _stage_digests(local_default_run, "pilot")  # one process


def test_two_nodes_dry_run_asks_for_nodes_gpus_per_node_and_one_launcher_per_node(slurm_cluster, tmp_path):
    workdir = slurm_workdir(tmp_path / "wf")
    (workdir / "nodes.yaml").write_text(yaml.safe_dump(
        {"train": {"nodes": 2, "gpus_per_node": 2, "rdzv_port": 29400, "socket_ifname": "ib0"}}))
    dry = slurm_cluster.snakemake(workdir, f"{RUN}/stages/pilot", "-n", "-p", "--workflow-profile",
                                  "profiles/default", "--configfile", "nodes.yaml")
    dry.check()
    block = dry.stdout[dry.stdout.index("rule train_stage"):]
    resources = next(line for line in block.splitlines() if line.strip().startswith("resources:"))
    for flag in ("nodes=2", "mpi=srun", "tasks=2", "gres=gpu:2"):
        assert flag in resources, resources
    launcher = next(line for line in block.splitlines() if "pipeline.launch" in line)
    for flag in ("--train", "--nodes 2", f"--rdzv-timeout {RDZV_TIMEOUT_S}", "--rdzv-port 29400",
                 "--socket-ifname ib0"):
        assert flag in launcher, launcher
    # What that launcher starts inside a 2-node allocation: one torchrun agent per node.
    args = launcher.split("pipeline.launch", 1)[1].split()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))},
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[1-2]"}
    printed = subprocess.run([sys.executable, "-m", "pipeline.launch", *args[:args.index("--")], "--print-command",
                              *args[args.index("--"):]],
                             cwd=workdir, env=env, capture_output=True, text=True)
    assert printed.returncode == 0, printed.stderr
    command = printed.stdout.strip()
    for flag in ("srun --nodes=2 --ntasks=2 --ntasks-per-node=1", "--gpus-per-node=2", "--nnodes=2",
                 "--rdzv-backend=c10d", "--rdzv-endpoint=node1:29400", f"--rdzv-conf=join_timeout={RDZV_TIMEOUT_S}"):
        assert flag in command, command
