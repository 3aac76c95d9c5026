"""Fixtures for tests that run Snakemake against a real SLURM cluster of two nodes on this host.

``slurm_cluster`` (session scope) runs ``tests/slurm/cluster.sh start`` once,
which installs slurm-wlm + munge if needed, writes /etc/slurm/slurm.conf, makes
one network namespace per node (own address, hostname, slurmd; README.md here)
and starts munged, slurmctld and the slurmds; ``cluster.sh stop`` takes it all
down at the end of the session (set ``SLURM_TEST_KEEP_CLUSTER=1`` to leave it running).

``SLURM_TEST_FAKE_GPUS=N`` (read by cluster.sh) declares N fake GPUs per node so that
rules asking ``gpu=N`` are accepted by sbatch (CUDA_VISIBLE_DEVICES is set,
no real device behind it). The fixture declares 2 unless told otherwise: the
pipeline's training and evaluation rules ask for ``gpu=1`` each, and a stage's
evaluation runs beside the next stage's training, as in a local run.

The tests are skipped when the machine cannot host the cluster (not root, or
SLURM is missing and there is no apt-get).  Under CI (``CI=true``) those cases
fail instead, so a misconfigured runner cannot silently skip the SLURM suite.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from kits.slurm import clean_env

HERE = Path(__file__).resolve().parent
CLUSTER_SH = HERE / "cluster.sh"
PROFILE_DIR = HERE / "profile"
PARTITION = "debug"
SECOND_PARTITION = "gpu"  # cluster.sh declares it on the same node; the test profile sends jobs there

_SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "munged")
# apt-get install of slurm-wlm takes well under a minute with a warm mirror;
# leave room for a slow one.
_START_TIMEOUT_S = int(os.environ.get("SLURM_TEST_SETUP_TIMEOUT", "900"))


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def _skip_or_fail(reason: str) -> None:
    if _in_ci():
        pytest.fail(f"SLURM tests cannot run under CI: {reason}", pytrace=False)
    pytest.skip(reason)


@dataclass
class SnakemakeRun:
    returncode: int
    stdout: str
    seconds: float
    cmd: list[str]

    def check(self) -> "SnakemakeRun":
        assert self.returncode == 0, (
            f"snakemake failed (rc={self.returncode}) after {self.seconds:.1f}s\n"
            f"cmd: {' '.join(self.cmd)}\n{self.stdout[-6000:]}"
        )
        return self


@dataclass
class SlurmCluster:
    """Handle on the running test cluster."""

    script: Path
    profile: Path
    partition: str
    second_partition: str
    nodes: dict[str, str]  # node name (its hostname too) -> its address, in slurm.conf's order
    fake_gpus: int

    def snakemake(
        self,
        workdir: Path,
        *args: str,
        timeout: float = 600,
        env: dict[str, str] | None = None,
    ) -> SnakemakeRun:
        """Run ``python -m snakemake --profile <test profile> *args`` in workdir (through
        snakemake_poll.py, which only polls SLURM more often).

        Uses the interpreter running pytest, the same one the plugin uses
        inside the jobs (``sys.executable -m snakemake``).  stderr is merged
        into stdout.  Pass ``--workflow-profile <dir>`` yourself when workdir
        is not the repository root.
        """
        cmd = self.snakemake_cmd(*args)
        t0 = time.monotonic()
        proc = subprocess.run(
            cmd,
            cwd=workdir,
            env=clean_env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
        return SnakemakeRun(proc.returncode, proc.stdout, time.monotonic() - t0, cmd)

    def snakemake_cmd(self, *args: str) -> list[str]:
        # snakemake with the plugin's status polls capped (snakemake_poll.py): the same run, less idle
        return [sys.executable, str(Path(__file__).with_name("snakemake_poll.py")), "--profile", str(self.profile),
                *args]

    def start_snakemake(
        self, workdir: Path, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """Like snakemake() but returns the running Popen (stdout+stderr piped),
        for tests that act on the SLURM jobs while the workflow runs."""
        return subprocess.Popen(
            self.snakemake_cmd(*args),
            cwd=workdir,
            env=clean_env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def jobs_from(self, workdir: Path) -> list[str]:
        """Jobs still queued, running or completing that were submitted from `workdir` or below it,
        as 'id|state|rule'."""
        out = subprocess.run(
            ["squeue", "--noheader", "--format=%i|%T|%k|%Z"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        root = Path(workdir).resolve()
        jobs = (line.rsplit("|", 1) for line in out.splitlines())
        return [job for job, cwd in jobs if Path(cwd.strip()).is_relative_to(root)]

    def check_no_job_left(self, workdir: Path, grace_s: float = 30.0) -> None:
        """Every job a finished snakemake submitted from `workdir` has left the queue. A job that
        outlives it holds a node's CPUs and GPUs from the tests that follow: cancel it, then fail."""
        deadline = time.monotonic() + grace_s
        while (left := self.jobs_from(workdir)) and time.monotonic() < deadline:
            time.sleep(1)
        if left:
            subprocess.run(["scancel", *(line.split("|", 1)[0] for line in left)], check=False)
            pytest.fail(f"SLURM jobs outlived the snakemake run in {workdir} (cancelled now): {left}",
                        pytrace=False)

    def record_sbatch(self, where: Path) -> tuple[dict[str, str], Path]:
        """An environment whose `sbatch` (a shim first on PATH) submits as usual and appends what
        slurmctld made of each job (`scontrol show job -o`: partition, account, GPUs, time limit,
        the plugin's comment naming the rule) to the returned file, for snakemake(..., env=...)."""
        real = shlex.quote(shutil.which("sbatch"))
        shim_dir = Path(where) / "sbatch_shim"
        shim_dir.mkdir(parents=True, exist_ok=True)
        record = Path(where) / "sbatch_jobs.txt"
        shim = shim_dir / "sbatch"
        quoted = shlex.quote(str(record))
        shim.write_text(
            "#!/bin/bash\n"
            f'out="$({real} "$@")"; rc=$?\n'
            'printf "%s\\n" "$out"\n'
            f'[ $rc -eq 0 ] && scontrol show job -o "${{out%%;*}}" >> {quoted}\n'
            "exit $rc\n"
        )
        shim.chmod(0o755)
        return {"PATH": f"{shim_dir}:{os.environ['PATH']}"}, record

    def node_processes(self, node: str, workdir: Path, needle: str) -> list[int]:
        """Processes running on `node` (in its network namespace) in `workdir` whose command line
        holds `needle`: what to kill or stop to take a node's share of a job down."""
        pids = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True, check=True).stdout.split()
        found = []
        for pid in pids:
            try:
                cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if cwd == Path(workdir).resolve() and needle in cmdline:
                found.append(int(pid))
        return found

    def job_state(self, job_id: str) -> str:
        """The job's state as slurmctld remembers it (MinJobAge), '' when it forgot it."""
        out = subprocess.run(["squeue", "--states=all", "--noheader", "--format=%T", "-j", job_id],
                             capture_output=True, text=True).stdout.strip()
        return out.splitlines()[0] if out else ""

    def squeue(self) -> str:
        """All jobs slurmctld still remembers (MinJobAge), as 'id|state|name'."""
        return subprocess.run(
            ["squeue", "--states=all", "--noheader", "--format=%i|%T|%j"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout


FAKE_GPUS = int(os.environ.get("SLURM_TEST_FAKE_GPUS") or 2)


def _run_cluster_sh(action: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(CLUSTER_SH), action],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        env=clean_env({"SLURM_TEST_FAKE_GPUS": str(FAKE_GPUS)}),
    )


@pytest.fixture(scope="session")
def slurm_cluster():
    """Start the SLURM test cluster (two nodes on this host) for the session; stop it afterwards."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        _skip_or_fail("the local SLURM cluster needs root (tests/slurm/cluster.sh)")
    have_slurm = all(shutil.which(b) for b in _SLURM_BINARIES)
    if not have_slurm and shutil.which("apt-get") is None:
        _skip_or_fail("SLURM is not installed and apt-get is unavailable to install it")

    try:
        proc = _run_cluster_sh("start", _START_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"cluster.sh start did not finish within {_START_TIMEOUT_S}s:\n"
            f"{exc.stdout or ''}",
            pytrace=False,
        )
    if proc.returncode != 0:
        pytest.fail(
            f"cluster.sh start failed (rc={proc.returncode}):\n{proc.stdout}",
            pytrace=False,
        )

    shown = subprocess.run(["scontrol", "show", "nodes", "-o"], capture_output=True, text=True, check=True).stdout
    nodes = {fields["NodeName"]: fields["NodeAddr"]
             for fields in (dict(re.findall(r"(\w+)=(\S*)", line)) for line in shown.splitlines()) if fields}
    try:
        yield SlurmCluster(
            script=CLUSTER_SH,
            profile=PROFILE_DIR,
            partition=PARTITION,
            second_partition=SECOND_PARTITION,
            nodes=nodes,
            fake_gpus=FAKE_GPUS,
        )
    finally:
        if os.environ.get("SLURM_TEST_KEEP_CLUSTER", "") not in {"1", "true", "yes"}:
            stop = _run_cluster_sh("stop", 180)
            if stop.returncode != 0:
                print(f"cluster.sh stop failed:\n{stop.stdout}", file=sys.stderr)


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test(request):
    """After each test that used the cluster, nothing it submitted from its tmp_path is still queued."""
    if "slurm_cluster" not in request.fixturenames:
        yield
        return
    cluster, tmp = request.getfixturevalue("slurm_cluster"), request.getfixturevalue("tmp_path")
    yield
    cluster.check_no_job_left(tmp)
