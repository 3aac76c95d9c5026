"""What each kind of job asks a cluster for (pipeline/planning/resources.py), from the workflow config
and the model's size; tests/workflow/test_resources.py shows the rules use it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from snakemake.utils import validate

from pipeline.planning.resources import (BENCHMARK, CPU, EVALUATE, MERGE, SMOKE, TRAIN, TRAIN_SIGNAL, VERIFY,
                                         job_resources, training_threads, weights_bytes)

REPO = Path(__file__).resolve().parents[2]
KINDS = (TRAIN, EVALUATE, VERIFY, SMOKE, BENCHMARK, MERGE, CPU)
GIB = 2**30


@pytest.fixture(scope="module")
def shipped() -> dict:
    """config/config.yaml with the schema's defaults filled in, as the Snakefile sees it."""
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    validate(config, str(REPO / "workflow/schemas/config.schema.yaml"))
    return config


def _config(shipped, **sections) -> dict:
    config = copy.deepcopy(shipped)
    for key, values in sections.items():
        config[key].update(values)
    return config


def _sparse_model(path: Path, size: int) -> Path:
    """A model dir whose weight file has `size` bytes on paper (sparse: no disk used)."""
    path.mkdir()
    with open(path / "model.safetensors", "wb") as f:
        f.truncate(size)
    return path


def test_one_node_asks_for_its_gpus_and_cpus_and_memory_per_rank(shipped):
    res = job_resources(TRAIN, _config(shipped, train={"gpus_per_node": 4}), 0)
    assert (res["nodes"], res["gpu"], res["cpus_per_task"], res["mem_mb"]) == (1, 4, 16, 4 * 6000)
    assert not {"mpi", "tasks", "gres"} & set(res)


def test_two_nodes_ask_for_gpus_per_node_and_one_task_per_node(shipped):
    res = job_resources(TRAIN, _config(shipped, train={"nodes": 2, "gpus_per_node": 8, "nproc": 8}), 0)
    assert (res["nodes"], res["mpi"], res["tasks"], res["gres"]) == (2, "srun", 2, "gpu:8")
    assert "gpu" not in res and res["cpus_per_task"] == 32 and res["mem_mb"] == 8 * 6000


def test_a_cluster_gets_one_gpu_for_auto_and_none_for_zero(shipped):
    assert job_resources(TRAIN, shipped, 0)["gpu"] == 1  # gpus_per_node: auto
    cpu_only = job_resources(TRAIN, _config(shipped, train={"gpus_per_node": 0}), 0)
    assert "gpu" not in cpu_only and cpu_only["cpus_per_task"] == 4


def test_training_runtime_grows_with_the_attempt(shipped):
    runtime = job_resources(TRAIN, shipped, 0)["runtime"]
    assert [runtime(None, attempt) for attempt in (1, 2, 3)] == [240, 480, 720]


def test_memory_follows_the_model_size(shipped, tmp_path):
    model = _sparse_model(tmp_path / "big_model", 20 * GIB)
    size = weights_bytes(model)
    assert size == 20 * GIB
    train = job_resources(TRAIN, _config(shipped, train={"gpus_per_node": 1}), size)
    assert train["mem_mb"] == int(20 * 1024 * 1.25) + 6000  # one copy of the base + 6 GB per rank
    for kind in (EVALUATE, VERIFY, SMOKE):  # one model at a time, fp32 on a CPU
        assert job_resources(kind, shipped, size)["mem_mb"] == 2 * 20 * 1024 + 4000, kind
    # The streaming merge holds a tensor at a time: no growth. A small model keeps the floors.
    assert job_resources(MERGE, shipped, size)["mem_mb"] == 8000
    assert job_resources(TRAIN, shipped, 10 * 2**20)["mem_mb"] == 8000
    assert job_resources(EVALUATE, shipped, 10 * 2**20)["mem_mb"] == 16000


@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_evaluation_verify_and_smoke_test_ask_for_evaluate_gpus(shipped, gpus):
    config = _config(shipped, evaluate={"gpus": gpus})
    for kind in (EVALUATE, VERIFY, SMOKE):
        res = job_resources(kind, config, 0)
        assert res.get("gpu") == (gpus or None), (kind, res)
        assert res["cpus_per_task"] == 4 and res["mem_mb"] >= 16000, (kind, res)
    # training's GPUs are train.gpus_per_node's, never evaluate.gpus'
    assert job_resources(TRAIN, config, 0)["gpu"] == 1


def test_evaluation_runtime_grows_with_the_attempt_verify_and_smoke_keep_an_hour(shipped):
    assert job_resources(EVALUATE, shipped, 0)["runtime"](None, 2) == 120
    assert job_resources(VERIFY, shipped, 0)["runtime"] == 60
    assert job_resources(SMOKE, shipped, 0)["runtime"] == 60


@pytest.mark.parametrize("gpus", [0, 1])
def test_a_benchmark_job_is_sized_like_an_evaluation_with_four_hours_per_attempt(shipped, tmp_path, gpus):
    """One model at a time on evaluate.gpus GPUs (lm-eval scores it on one device), its memory from the
    model's size; generative tasks decode every answer, so the runtime is four hours per attempt."""
    size = weights_bytes(_sparse_model(tmp_path / "model", 20 * GIB))
    config = _config(shipped, evaluate={"gpus": gpus})
    bench, evaluation = job_resources(BENCHMARK, config, size), job_resources(EVALUATE, config, size)
    assert {k: v for k, v in bench.items() if k != "runtime"} == {k: v for k, v in evaluation.items() if k != "runtime"}
    assert bench.get("gpu") == (gpus or None) and bench["mem_mb"] == 2 * 20 * 1024 + 4000
    assert [bench["runtime"](None, attempt) for attempt in (1, 2)] == [240, 480]


def test_cpu_jobs_ask_for_no_gpu_and_leave_the_rest_to_the_profile(shipped):
    assert job_resources(CPU, shipped, 100 * GIB) == {}
    assert job_resources(MERGE, shipped, 0) == {"cpus_per_task": 2, "mem_mb": 8000, "runtime": 120}


def test_null_slurm_settings_set_no_slurm_resource(shipped):
    """null = the user's profile decides: the key is absent, so its default-resources apply."""
    for kind in KINDS:
        assert not any(key.startswith("slurm_") for key in job_resources(kind, shipped, 0)), kind


def test_each_kind_takes_its_groups_slurm_settings(shipped):
    config = _config(shipped, slurm={"train": {"partition": "gpu-long", "account": "lab-a"},
                                     "evaluate": {"partition": "gpu-short", "account": None, "extra": "--exclusive"},
                                     "cpu": {"partition": "cpu", "account": "lab-c"}})
    got = {kind: {k: v for k, v in job_resources(kind, config, 0).items() if k.startswith("slurm_")} for kind in KINDS}
    assert got[TRAIN] == {"slurm_partition": "gpu-long", "slurm_account": "lab-a"}
    for kind in (EVALUATE, VERIFY, SMOKE, BENCHMARK):
        assert got[kind] == {"slurm_partition": "gpu-short", "slurm_extra": "--exclusive"}, kind
    for kind in (MERGE, CPU):
        assert got[kind] == {"slurm_partition": "cpu", "slurm_account": "lab-c"}, kind


def test_a_training_extra_keeps_the_preemption_signal(shipped):
    """slurm_extra of a rule replaces the profile's (which carries --signal=USR1@...): training's
    checkpoint-and-resume on preemption must not be dropped by an extra flag."""
    extra = job_resources(TRAIN, _config(shipped, slurm={"train": {"extra": "--mail-type=FAIL"}}), 0)["slurm_extra"]
    assert extra == f"{TRAIN_SIGNAL} --mail-type=FAIL"
    own = job_resources(TRAIN, _config(shipped, slurm={"train": {"extra": "--signal=USR1@900 --exclusive"}}), 0)
    assert own["slurm_extra"] == "--signal=USR1@900 --exclusive"


def test_weights_bytes_counts_safetensors_else_bin_and_zero_without_a_dir(tmp_path):
    assert weights_bytes(tmp_path / "absent") == 0 and weights_bytes(None) == 0
    (tmp_path / "m").mkdir()
    (tmp_path / "m/pytorch_model.bin").write_bytes(b"x" * 10)
    assert weights_bytes(tmp_path / "m") == 10
    (tmp_path / "m/model-00001-of-00002.safetensors").write_bytes(b"x" * 3)
    (tmp_path / "m/model-00002-of-00002.safetensors").write_bytes(b"x" * 4)
    assert weights_bytes(tmp_path / "m") == 7  # the safetensors, not the .bin beside them


def test_training_threads_leave_a_core_locally_and_are_one_without_a_core_count():
    assert [training_threads(c) for c in (None, 1, 2, 16)] == [1, 1, 1, 15]


def test_an_unknown_kind_is_refused(shipped):
    with pytest.raises(ValueError, match="unknown kind of job 'gpu'"):
        job_resources("gpu", shipped, 0)
