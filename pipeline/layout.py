"""Every on-disk name the pipeline uses, in one place.

The results tree, the checkpoint layout and the state-dict keys are part of the
contract between stages (and with the Snakefile), so they are named here and
nowhere else. See DESIGN.md "Results tree". The workflow's rules take every path
from `RunTree` and the functions below (the Snakefile imports this module: no
torch here); tests/workflow/test_layout.py fails on a results path spelled in a
rule file.
"""

from __future__ import annotations

from pathlib import Path

# --- checkpoint directory (stage output and intra-stage scratch share it) ---
ADAPTER_DIR = "adapter"  # PEFT dir (adapter_config.json + adapter_model.safetensors)
MODEL_DIR = "model"  # full fine-tuning: HF safetensors weights of the trained model
EMA_DIR = "ema"  # ema/<rate>/ : PEFT dir (or model dir) holding the fp32 shadow
TRAINING_STATE_DIR = "training_state"
CHECKPOINT_CONFIG_FILE = "config.yaml"  # the run's train_config.yaml (TRAIN_CONFIG_FILE) as the checkpoint was trained with
MANIFEST_FILE = "MANIFEST.json"  # written last: its presence means "complete"

# files inside training_state/
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"
SCHEDULER_FILE = "scheduler.json"
SCALER_FILE = "scaler.json"
PROGRESS_FILE = "progress.json"
RNG_TENSORS = "rng_rank{rank:03d}.safetensors"
RNG_META = "rng_rank{rank:03d}.json"

# PEFT file names (stock peft reads these)
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"

# --- sharded (FSDP) checkpoint: <ckpt>/dcp/ written with torch.distributed.checkpoint.save ---
# State dict {"model": {name: tensor}, "ema": {tag: {name: tensor}}} (DCP flattens it to the
# keys below). <name> is a PEFT adapter key (`base_model.model.<module>.lora_A.weight`) in
# LoRA runs, an HF checkpoint key (`model.layers.0.mlp.up_proj.weight`) in full fine-tuning.
# LoRA runs also put the adapter_config.json (PEFT_CONFIG) inside the dcp/ dir.
DCP_DIR = "dcp"
DCP_MODEL_PREFIX = "model."  # model.<name>
DCP_EMA_PREFIX = "ema."  # ema.<tag>.<name>

# --- scratch dir of one stage: work/<run>/<stage>/ ---
STEP_DIR = "step_{step:06d}"  # one intra-stage checkpoint (a checkpoint dir as above)
STEP_GLOB = "step_*"
LATEST_FILE = "LATEST"
SCRATCH_METRICS = "metrics.jsonl"
ALERTS_FILE = "alerts.jsonl"  # loss spikes and throughput drops, one JSON line each
SCRATCH_STATUS = "status.json"  # where the stage is now (rank 0 replaces it every few seconds)
# Best weights by validation loss, one dir per update that improved (an attempt that died
# after a newer best never overwrites the one a resumed attempt keeps):
BEST_DIR = "best"  # best/<kind>/step_XXXXXX/ in scratch; best/<kind>/ in the stage output
BEST_KINDS = ("raw", "ema")
BEST_META = "best.json"  # stage, update, validation loss, EMA rate of the best weights

# --- stage output dir: results/<run>/stages/<stage>/ ---
STAGE_CHECKPOINT = "checkpoint"
STAGE_METRICS = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"  # TensorBoard event files of a stage (train.tensorboard=true)
PROFILE_DIR = "profile"  # a stage's profiler trace and its summary (trainer profile.updates > 0)
PROFILE_TRACE = "trace_updates_{start}-{end}.json"  # Chrome trace format (chrome://tracing, Perfetto)
PROFILE_SUMMARY = "summary.json"  # seconds and shares of the time per category

# --- the training stage's progress line (`pipeline.train.monitor.Progress`) ---
PROGRESS_ENV = "SFT_PROGRESS"  # "0": no line on the terminal (the log keeps its lines)
PROGRESS_TTY_ENV = "SFT_PROGRESS_TTY"  # the terminal Snakemake runs in (/dev/pts/N), set by pipeline.launch
RDZV_ENDPOINT_ENV = "SFT_RDZV_ENDPOINT"  # a multi-rank stage's rendezvous host:port, set by pipeline.launch
RANK_QUIET = "stopped answering"  # how pipeline.watch says a rank went quiet (the launcher shows those lines)

# --- exit codes the workflow understands ---
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: a checkpoint was saved, retry to resume
EXIT_GATE = 77  # pilot gate refused


def ema_tag(rate: float) -> str:
    """Directory name of one EMA rate: 0.999 -> '0.999' (stable, no exponent)."""
    text = f"{rate:.10f}".rstrip("0").rstrip(".")
    return text


def step_dir(scratch: Path, step: int) -> Path:
    return Path(scratch) / STEP_DIR.format(step=step)


def step_of(step_dir_name: str) -> int:
    """'step_000050' -> 50."""
    return int(step_dir_name.split("_")[1])


def best_dir(scratch: Path, kind: str, step: int) -> Path:
    """Where a stage's scratch keeps the best `kind` weights found at update `step`."""
    return Path(scratch) / BEST_DIR / kind / STEP_DIR.format(step=step)


# --- the results tree: what the workflow writes, relative to the dir snakemake runs in ---
RESULTS = "results"  # results/<run>/: a RunTree
WORK = "work"  # work/<vrun>/<stage>/: a stage's undeclared scratch (intra-stage checkpoints)
LOGS = "logs"  # logs/<rule>/<key>.log
BENCHMARKS = "benchmarks"  # benchmarks/<rule>/<key>.tsv (Snakemake's per-job benchmark)
LOG_SUFFIX = ".log"
BENCHMARK_SUFFIX = ".tsv"

# dirs of a run dir
DATA_DIR = "data"
STAGES_DIR = "stages"
EVAL_DIR = "eval"
REPORT_DIR = "report"
EXPORT_DIR = "export"
SWEEP_DIR = "sweep"
VARIANTS_DIR = "variants"  # a sweep's variant: results/<run>/variants/<name>/ (vrun = <run>/variants/<name>)
TRACKER_DIR = "tracker"  # the experiment tracker's state and errors.jsonl
TOKENIZER_DIR = "tokenizer"  # the run's tokenizer and chat template (`prepare_tokenizer`)
BASE_MODEL_DIR = "model"  # an embedded demo's base model (`prepare_base`): results/<demo>/model/
ARCHIVE_DIR = "archive"  # archive/<when>-<old config id>/: outputs of an earlier config (planning/guard.py)

# files of a run dir
PLAN_FILE = "plan.json"
TRAIN_CONFIG_FILE = "train_config.yaml"  # the resolved trainer config every stage trains with
PILOT_REPORT_FILE = "pilot_report.json"
HUB_MODEL_FILE = "model.json"  # a hub model's pinned commit (`fetch_model`)
ARCHIVED_FILE = "ARCHIVED.json"  # in an archive dir: what it holds and why it was moved

# data/
VALIDATION_JSON = "validation.json"
VALIDATION_CSV = "validation.csv"
VALIDATION_FAILED_DIR = "validation_failed"  # undeclared: a failed validation's reports
STATS_FILE = "stats.json"
TRAIN_SETS_DIR = "train"  # data/train/<name>/: one training dataset (its reports, stats and cache)
SINGLE_TRAIN_SET = "train"  # the name of the one training dataset of a run that gives a file, not a list
TRAIN_SET_CACHE = "train.safetensors"
TRAIN_SET_DROPPED = "dropped.npy"  # the records duplicates=drop leaves out of the cache (found across shards)
TRAIN_SET_SHARDS = "shards.json"  # each shard's records and time (validation and tokenization)
SHARDS_DIR = "shards"  # data/train/<name>/shards/: a large dataset's shard jobs' outputs
VAL_STATS_FILE = "val_stats.json"  # the validation set's own tokenization stats
DATA_SHARDS_FILE = "shards.json"  # data/shards.json: every training dataset's shards and their times
CACHE_SUFFIX = ".safetensors"  # data/<split>.safetensors: a tokenized split
DEMO_SPLIT_SUFFIX = ".jsonl"  # data/<split>.jsonl: an embedded demo's dataset split
HUB_DATA_DIR = "hub"  # data/hub/<split>.hub.json, data/hub/train/<name>.hub.json: a hub dataset's pin (`fetch_data`)
HUB_PIN_SUFFIX = ".hub.json"

# eval/: <stage>.json per evaluation, the base model's as BASE_EVAL
BASE_EVAL = "base"
SUMMARY_CSV = "summary.csv"
LOSS_PLOT = "loss.png"
VAL_LOSS_PLOT = "val_loss.png"
# eval/bench/<weights>/<task>.json: one lm-eval benchmark job's scores (`python -m pipeline benchmark`);
# the base model's in the run dir (shared by a sweep's variants), the trained weights' in each variant's.
BENCH_DIR = "bench"
BENCH_SUFFIX = ".json"
BENCH_CACHE_DIR = "cache"  # eval/bench/cache/<key>.json (run dir): scores by weights content + task + settings
BENCH_BASE = "base"  # the weights name of the base model (evaluate.benchmarks.weights)
BENCHMARKS_CSV = "benchmarks.csv"  # task, metric, base, final, delta and their standard errors
BENCHMARKS_PLOT = "benchmarks.png"
BENCHMARK_CARDS = "benchmarks.md"  # export/: the benchmark sections `benchmark-card` put into the model cards
# The embedded demo's own benchmark (`demo-benchmark`): a multiple-choice lm-eval task over local JSONL,
# data/bench/<DEMO_BENCH_TASK>.yaml and .jsonl in the demo's dir (`evaluate.benchmarks.tasks: [embedded]`).
DEMO_BENCH_TASK = "repeat_choice"

# report/: the pages of `snakemake --report`
OVERVIEW_PAGE = "overview.html"  # the report's landing page
SUMMARY_PAGE = "summary.html"
SAMPLES_PAGE = "samples.html"
PLAN_PAGE = "plan.html"
PILOT_GATE_PAGE = "pilot_gate.html"
LABELS_PAGE = "labels.html"  # what the run trains on, shared by a sweep's variants
DATA_PAGE = "data.html"  # the training datasets: files, records, shards and each shard's time
BENCHMARKS_PAGE = "benchmarks.html"  # the lm-eval benchmarks: base vs the trained weights

# export/<name>/: Hugging Face dirs (from_pretrained), each with its model card
ADAPTER_FINAL = "adapter_final"
ADAPTER_EMA = "adapter_ema"
ADAPTER_BEST = "adapter_best"
ADAPTER_BEST_EMA = "adapter_best_ema"
MERGED = "merged"
VERIFICATION_FILE = "verification.json"
SMOKE_TEST_FILE = "smoke_test.json"

# sweep/
PRUNE_DIR = "prune"  # sweep/prune/<stage>.json: who goes on after <stage>
COMPARISON_CSV = "comparison.csv"
COMPARISON_PLOT = "loss.png"
COMPARISON_HTML = "comparison.html"
BEST_FILE = "best.json"
BEST_LINK = "best"  # sweep/best -> ../variants/<name>: the best variant at a fixed path


class RunTree:
    """The files of one run dir: results/<run>/, a sweep variant's results/<run>/variants/<name>/,
    or an embedded demo's results/<demo>/.

    Every path is a Path under `root`; a Snakemake pattern for a root keeps its wildcards, so
    the rules and the package name the same files:
    `RunTree("results/{vrun}").stage("{stage}")` is results/{vrun}/stages/{stage}.
    str() of a tree is its root (what a rule's shell command or `--run` takes).
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @classmethod
    def of(cls, run: str) -> RunTree:
        """The tree of results/<run> (run: a run's name, a vrun or a Snakemake wildcard)."""
        return cls(Path(RESULTS) / run)

    def __str__(self) -> str:
        return str(self.root)

    def __repr__(self) -> str:
        return f"RunTree({str(self.root)!r})"

    # the run: its base model, tokenizer and data, shared by a sweep's variants
    @property
    def hub_model(self) -> Path:
        return self.root / HUB_MODEL_FILE

    @property
    def base_model(self) -> Path:
        return self.root / BASE_MODEL_DIR

    @property
    def tokenizer(self) -> Path:
        return self.root / TOKENIZER_DIR

    def demo_split(self, split: str) -> Path:
        return self.root / DATA_DIR / f"{split}{DEMO_SPLIT_SUFFIX}"

    def hub_data(self, key: str) -> Path:
        """The pin of a dataset given by hub URL (`fetch_data`): key `val`, `test` or `train/<name>`."""
        return self.root / DATA_DIR / HUB_DATA_DIR / f"{key}{HUB_PIN_SUFFIX}"

    def cache(self, split: str) -> Path:
        return self.root / DATA_DIR / f"{split}{CACHE_SUFFIX}"

    def demo_bench_task(self, suffix: str = ".yaml") -> Path:
        """data/bench/<DEMO_BENCH_TASK>.yaml (the lm-eval task) and .jsonl (its documents) of a demo
        (`demo-benchmark`, pipeline.demo.benchmark, writes them into the demo's data dir)."""
        return self.root / DATA_DIR / BENCH_DIR / f"{DEMO_BENCH_TASK}{suffix}"

    @property
    def stats(self) -> Path:
        return self.root / DATA_DIR / STATS_FILE

    @property
    def validation_json(self) -> Path:
        return self.root / DATA_DIR / VALIDATION_JSON

    @property
    def validation_csv(self) -> Path:
        return self.root / DATA_DIR / VALIDATION_CSV

    @property
    def validation_failed(self) -> Path:
        return self.root / DATA_DIR / VALIDATION_FAILED_DIR

    # the training datasets (data.train: one file, or a list): each in a dir of its own, made by jobs of its own
    def train_set(self, name: str) -> Path:
        """data/train/<name>/: one training dataset's validation.json/.csv, stats.json and token cache."""
        return self.root / DATA_DIR / TRAIN_SETS_DIR / name

    def train_set_cache(self, name: str) -> Path:
        return self.train_set(name) / TRAIN_SET_CACHE

    def train_set_stats(self, name: str) -> Path:
        return self.train_set(name) / STATS_FILE

    def train_set_validation_json(self, name: str) -> Path:
        return self.train_set(name) / VALIDATION_JSON

    def train_set_validation_csv(self, name: str) -> Path:
        return self.train_set(name) / VALIDATION_CSV

    def train_set_validation_failed(self, name: str) -> Path:
        return self.train_set(name) / VALIDATION_FAILED_DIR

    def train_set_dropped(self, name: str) -> Path:
        return self.train_set(name) / TRAIN_SET_DROPPED

    def train_set_shards(self, name: str, step: str) -> Path:
        """data/train/<name>/<step>_shards.json: each shard's records and time in validation or tokenization."""
        return self.train_set(name) / f"{step}_{TRAIN_SET_SHARDS}"

    def shard_scan(self, name: str, shard: int | str) -> Path:
        """A shard's validation facts (a .json and its .npz; `pipeline.data.scan`)."""
        return self.train_set(name) / SHARDS_DIR / f"validate-{shard}.json"

    def shard_part(self, name: str, shard: int | str) -> Path:
        """A shard's part of the token cache (and its .json; `pipeline.data.parts`)."""
        return self.train_set(name) / SHARDS_DIR / f"tokenize-{shard}{CACHE_SUFFIX}"

    @property
    def data_shards(self) -> Path:
        return self.root / DATA_DIR / DATA_SHARDS_FILE

    @property
    def val_stats(self) -> Path:
        return self.root / DATA_DIR / VAL_STATS_FILE

    # a trained run (a sweep's variant, or the run itself)
    @property
    def plan(self) -> Path:
        return self.root / PLAN_FILE

    @property
    def train_config(self) -> Path:
        return self.root / TRAIN_CONFIG_FILE

    @property
    def pilot_report(self) -> Path:
        return self.root / PILOT_REPORT_FILE

    @property
    def stages(self) -> Path:
        return self.root / STAGES_DIR

    def stage(self, stage: str) -> Path:
        return self.stages / stage

    def evaluation(self, stage: str) -> Path:
        """eval/<stage>.json (the base model's: stage BASE_EVAL)."""
        return self.root / EVAL_DIR / f"{stage}.json"

    @property
    def summary_csv(self) -> Path:
        return self.root / EVAL_DIR / SUMMARY_CSV

    @property
    def loss_plot(self) -> Path:
        return self.root / EVAL_DIR / LOSS_PLOT

    @property
    def val_loss_plot(self) -> Path:
        return self.root / EVAL_DIR / VAL_LOSS_PLOT

    def benchmark(self, weights: str, task: str) -> Path:
        """eval/bench/<weights>/<task>.json: one (weights, lm-eval task) benchmark job's scores."""
        return self.benchmarks_of(weights) / f"{task}{BENCH_SUFFIX}"

    def benchmarks_of(self, weights: str) -> Path:
        """eval/bench/<weights>/: every benchmark score of one weights set."""
        return self.root / EVAL_DIR / BENCH_DIR / weights

    @property
    def benchmark_cache(self) -> Path:
        """eval/bench/cache/: benchmark scores by content key (undeclared: Snakemake deletes a job's
        outputs before it runs; a rerun on the same weights, task and settings copies them from here)."""
        return self.root / EVAL_DIR / BENCH_DIR / BENCH_CACHE_DIR

    @property
    def benchmarks_csv(self) -> Path:
        return self.root / EVAL_DIR / BENCHMARKS_CSV

    @property
    def benchmarks_plot(self) -> Path:
        return self.root / EVAL_DIR / BENCHMARKS_PLOT

    # report/: the pages of `snakemake --report` (summarize writes all but labels.html)
    @property
    def overview_html(self) -> Path:
        return self.root / REPORT_DIR / OVERVIEW_PAGE

    @property
    def summary_html(self) -> Path:
        return self.root / REPORT_DIR / SUMMARY_PAGE

    @property
    def samples_html(self) -> Path:
        return self.root / REPORT_DIR / SAMPLES_PAGE

    @property
    def plan_html(self) -> Path:
        return self.root / REPORT_DIR / PLAN_PAGE

    @property
    def pilot_gate_html(self) -> Path:
        return self.root / REPORT_DIR / PILOT_GATE_PAGE

    @property
    def labels_html(self) -> Path:
        return self.root / REPORT_DIR / LABELS_PAGE

    @property
    def data_html(self) -> Path:
        return self.root / REPORT_DIR / DATA_PAGE

    @property
    def benchmarks_html(self) -> Path:
        return self.root / REPORT_DIR / BENCHMARKS_PAGE

    @property
    def exports(self) -> Path:
        return self.root / EXPORT_DIR

    def export(self, name: str) -> Path:
        """export/<name>: ADAPTER_FINAL, ADAPTER_EMA, ADAPTER_BEST, ADAPTER_BEST_EMA, MERGED."""
        return self.exports / name

    @property
    def verification(self) -> Path:
        return self.exports / VERIFICATION_FILE

    @property
    def smoke_test(self) -> Path:
        return self.exports / SMOKE_TEST_FILE

    @property
    def benchmark_cards(self) -> Path:
        return self.exports / BENCHMARK_CARDS

    @property
    def tracker(self) -> Path:
        return self.root / TRACKER_DIR

    def archive(self, name: str) -> Path:
        """archive/<name>/: a run's trained outputs of an earlier config, moved aside (planning/guard.py)."""
        return self.root / ARCHIVE_DIR / name

    # a sweep: its variants and their comparison
    def variant(self, name: str) -> RunTree:
        return RunTree(self.root / VARIANTS_DIR / name)

    @property
    def variants(self) -> Path:
        return self.root / VARIANTS_DIR

    def prune_decision(self, stage: str) -> Path:
        return self.root / SWEEP_DIR / PRUNE_DIR / f"{stage}.json"

    @property
    def comparison_csv(self) -> Path:
        return self.root / SWEEP_DIR / COMPARISON_CSV

    @property
    def comparison_plot(self) -> Path:
        return self.root / SWEEP_DIR / COMPARISON_PLOT

    @property
    def comparison_html(self) -> Path:
        return self.root / SWEEP_DIR / COMPARISON_HTML

    @property
    def best_file(self) -> Path:
        return self.root / SWEEP_DIR / BEST_FILE

    @property
    def best_link(self) -> Path:
        return self.root / SWEEP_DIR / BEST_LINK


def variant_run(run: str, name: str) -> str:
    """The vrun (results/<vrun>/, work/<vrun>/) of a sweep's variant: <run>/variants/<name>."""
    return f"{run}/{VARIANTS_DIR}/{name}"


def sweep_of(tree: RunTree) -> RunTree | None:
    """The sweep run a variant's tree belongs to (results/<run>/variants/<name> -> results/<run>), else None."""
    return RunTree(tree.root.parent.parent) if tree.root.parent.name == VARIANTS_DIR else None


def work_dir(run: str) -> Path:
    """work/<run>/: the scratch of a run's stages, next to results/."""
    return Path(WORK) / run


def scratch_dir(vrun: str, stage: str) -> Path:
    """work/<vrun>/<stage>/: one stage's intra-stage checkpoints, kept across failed attempts."""
    return work_dir(vrun) / stage


def log_file(rule: str, key: str) -> Path:
    """logs/<rule>/<key>.log (key: the job's wildcards, e.g. "{vrun}/{stage}")."""
    return Path(LOGS) / rule / f"{key}{LOG_SUFFIX}"


def benchmarks_of(rule: str, group: str) -> Path:
    """benchmarks/<rule>/<group>/: the benchmark files of a rule's jobs that share a key prefix."""
    return Path(BENCHMARKS) / rule / group


def benchmark_file(rule: str, key: str) -> Path:
    """benchmarks/<rule>/<key>.tsv: Snakemake's wall clock and memory of one job."""
    return Path(BENCHMARKS) / rule / f"{key}{BENCHMARK_SUFFIX}"
