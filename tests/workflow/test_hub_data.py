"""`data.train` given by hub URL, offline: fetched once from a Hugging Face cache laid out as
`hf download --repo-type dataset` leaves it, pinned to its commit, its shards read as one dataset;
not cached, the workflow stops as it loads.

The cache holds the session's tiny training data (conftest `tiny`) as two Parquet shards of
`org/tiny-chat`; snakemake runs only up to the tokenized training data.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from kits.hub import add_to_cache, write_parquet_shards
from kits.run import REPO, copy_workflow, jobs_in_log, snakemake

from pipeline.data.cache import TokenCache
from pipeline.data.tokenize import load_tokenizer, tokenize_file, tokenizer_fingerprint

pytestmark = pytest.mark.workflow

REPO_ID = "org/tiny-chat"
URL = f"hf://datasets/{REPO_ID}/data/train-*.parquet"
TOKENIZED = "results/hub/data/train/train/train.safetensors"


def _env(cache: Path) -> dict:
    """Offline, this cache; snakemake and its jobs import this checkout's package (not an installed one)."""
    return {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "PYTHONPATH": str(REPO)}


def _config(workdir: Path, tiny: dict, train: str, **data) -> None:
    variant = {"run": "hub", "model": str(tiny["model"]),
               "data": {"train": train, "val": None, "test": None, "max_length": 64, **data}}
    (workdir / "hub.yaml").write_text(yaml.safe_dump(variant))


def test_a_cached_hub_dataset_is_fetched_once_pinned_and_tokenized_as_the_local_file(tiny, tmp_path):
    local = Path(tiny["root"]) / "data" / "train.jsonl"
    records = [json.loads(line) for line in local.read_text().splitlines() if line.strip()]
    repo = tmp_path / "repo"
    shards = write_parquet_shards(repo, records, 2)
    cache = tmp_path / "hf-cache"
    snapshot = add_to_cache(cache, REPO_ID, repo, repo_type="dataset")
    workdir = copy_workflow(tmp_path / "wf")
    # Split into shards by its size, which is known only once it is fetched: 2 shard jobs (validation and
    # tokenization each) in the first run already, as in every later one.
    shard_mb = sum(s.stat().st_size for s in shards) / 2**20 / 1.5
    _config(workdir, tiny, URL, shard_mb=shard_mb)
    env = _env(cache)
    proc = snakemake(workdir, TOKENIZED, "--cores", "all", "--configfile", "hub.yaml", env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    ran = [rule for rule, _ in jobs_in_log(proc.stdout + proc.stderr)]
    assert ran.count("fetch_data") == 1 and {"validate_dataset", "tokenize_dataset"} <= set(ran)
    assert ran.count("validate_shard") == ran.count("tokenize_shard") == 2, ran
    pin = json.loads((workdir / "results/hub/data/hub/train/train.hub.json").read_text())
    assert pin == {"url": URL, "repo_id": REPO_ID, "revision": snapshot.name, "pattern": "data/train-*.parquet",
                   "files": [str(snapshot / s.relative_to(repo)) for s in shards]}

    # The same records as the local file's, tokenized with the run's tokenizer.
    tokenizer_dir = workdir / "results/hub/tokenizer"
    expected = tmp_path / "local.safetensors"
    tokenize_file(local, load_tokenizer(tokenizer_dir), out_path=expected, max_length=64, too_long="error",
                  fingerprint=tokenizer_fingerprint(tokenizer_dir), split="train")
    got, want = TokenCache(workdir / TOKENIZED), TokenCache(expected)
    assert len(got) == len(want) == len(records)
    assert all(all((a == b).all() for a, b in zip(got[i], want[i])) for i in range(len(want)))

    # The pin is the dataset: a second run has nothing to fetch or redo.
    again = snakemake(workdir, TOKENIZED, "--cores", "all", "--configfile", "hub.yaml", env=env, timeout=120)
    assert again.returncode == 0 and jobs_in_log(again.stdout + again.stderr) == []


def test_an_uncached_hub_dataset_offline_stops_before_any_job_with_one_line(tiny, tmp_path):
    cache = tmp_path / "empty-cache"
    cache.mkdir()
    workdir = copy_workflow(tmp_path / "wf")
    url = "hf://datasets/org/not-cached@v1/data/train-*.parquet"
    _config(workdir, tiny, url)
    env = _env(cache)
    proc = snakemake(workdir, "-n", TOKENIZED, "--configfile", "hub.yaml", env=env, timeout=120)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    line = next(line for line in out.splitlines() if "org/not-cached" in line)
    assert line.strip() == (
        f"data.train: {url} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE=1 forbids downloading it: "
        f"run `hf download org/not-cached --repo-type dataset --revision v1 --include 'data/train-*.parquet' "
        f"--cache-dir {cache}` on a machine with network access (into that cache), or give a local dataset file")
    assert jobs_in_log(out) == []


def test_fetch_data_is_given_the_dataset_s_columns_to_find_its_images(tiny, tmp_path):
    """The `fetch_data` job reads the records for the image files beside them (pipeline/data/hub_images.py) with
    the dataset's own data.columns / data.roles: a dry run prints them in its command, and only there."""
    local = Path(tiny["root"]) / "data" / "train.jsonl"
    repo = tmp_path / "repo"
    write_parquet_shards(repo, [json.loads(line) for line in local.read_text().splitlines() if line.strip()], 2)
    cache = tmp_path / "hf-cache"
    add_to_cache(cache, REPO_ID, repo, repo_type="dataset")
    workdir = copy_workflow(tmp_path / "wf")
    # data.val names the whole repo: its fetch asks for the repo's validation split (pipeline/data/hub_splits.py)
    # data.test names a split by the dataset viewer's address (its `?` is no glob: the URL is one quoted word)
    viewer = f"https://huggingface.co/datasets/{REPO_ID}/viewer/default/train?row=3"
    _config(workdir, tiny, URL, val=f"hf://datasets/{REPO_ID}", test=viewer, columns={"image": "picture"},
            roles={"bot": "assistant"})
    proc = snakemake(workdir, "-n", "-p", TOKENIZED, "results/hub/data/val.safetensors",
                     "results/hub/data/hub/test.hub.json", "--configfile", "hub.yaml", env=_env(cache), timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    commands = sorted(line.strip() for line in proc.stdout.splitlines() if "python -m pipeline fetch-data" in line)
    assert len(commands) == 3, commands
    fetches = {c.split(" --out results/hub/data/hub/")[1].split(".hub.json")[0]: c for c in commands}
    assert fetches["train/train"].endswith("--out results/hub/data/hub/train/train.hub.json --split train "
                                           "--columns image=picture --roles bot=assistant"), commands
    assert f"--url hf://datasets/{REPO_ID} --out results/hub/data/hub/val.hub.json --split validation " in \
        fetches["val"]
    assert f"--url '{viewer}' --out results/hub/data/hub/test.hub.json --split test " in fetches["test"]
