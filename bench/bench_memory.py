"""CPU benchmark (issue 13): what one update costs in memory and time, before and after; padding of the default data.

    python bench/bench_memory.py                  # before = the trainer at 0603ead (before issue 13), after = this tree
    python bench/bench_memory.py --before <rev> --rounds 3
    python bench/bench_memory.py --smoke          # 1 round of 2 updates, 64-token records: checks it runs

Peak memory of one update. Our trainer, one process as the workflow runs a
stage (`python -m pipeline train`, through bench/_peak.py), on a Llama-style
model with a 32,000-token vocabulary (hidden 256, 4 layers, 4 heads,
intermediate 688, untied head; random init, fp32 on the CPU), LoRA and EMA at
their defaults, micro-batch 8 of 512-token records (global batch 8: one
micro-batch per update; the first 128 tokens of each record unsupervised, a
prompt). _peak.py samples the process RSS every millisecond during each
update; the figure is the largest rise above the RSS at the update's start,
over the updates of a run (median over rounds). "Before" is the trainer of
another commit (`git archive`, its own config/train), run by the same probe on
the same model and data; "after" is this tree. Goal: after <= 0.5 x before.

tokens/s: the trainer's own metrics.jsonl of the same runs (tokens per
update / update time), median over the updates after the first, median over
rounds; one torch thread (`--threads`).

Padding fraction of the default data: the embedded demo dataset tokenized as
the workflow does (max_length 128), the default run's batches (global batch 32,
micro-batch 16, seed 0) over its 300 updates: padding tokens / tokens the
forward computes. Before: micro-batches in sampled order (what the trainer did;
`tokens.group_by_length=false` does the same); after: grouped by length (the new
default). Computed from the sampler, no training.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

BEFORE = "0603ead"  # the last commit before issue 13's trainer changes
# The trainer keys the "before" trainer (BEFORE) knows: the names of its commit, whatever this tree's are.
BEFORE_KEYS = {"train_cache": "data.train_cache", "val_cache": "data.val_cache"}
AFTER_KEYS = {"train_cache": C.KEY_TRAIN_CACHE, "val_cache": C.KEY_VAL_CACHE}
SHAPE = dict(model_type="llama", hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=688, vocab_size=32000, tie_word_embeddings=False)


def _tree(rev: str, root: Path) -> Path:
    """The package and trainer config of commit `rev`, unpacked under `root`."""
    return C.git_tree(rev, root, ["pipeline", "config"], "the 'before' trainer")


def _model(root: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.demo import text as demo

    tok = demo.build_tokenizer()
    spec = dict(SHAPE)
    config = AutoConfig.for_model(spec.pop("model_type"), max_position_embeddings=1024, pad_token_id=tok.pad_token_id,
                                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **spec)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root)
    tok.save_pretrained(root)
    return root


def _config_args(tree: Path, env: dict, work: Path, overrides: list[str]) -> list[str]:
    """The plan's trainer config arguments as `tree`'s planner takes them: the resolved text, resolved by
    `tree`'s own package (since issue 34: pipeline/planning/run_config.py), or its config dir and overrides."""
    conf = tree / "config" / "train"
    if not (tree / "pipeline" / "planning" / "run_config.py").is_file():
        return ["--train-config-dir", str(conf), "--train-config-name", "config",
                *[a for o in overrides for a in ("--override", o)]]
    resolve = ("import sys; from pipeline import config as c; "
               "print(c.to_yaml(c.resolve(sys.argv[1], 'config', sys.argv[2:])), end='')")
    proc = subprocess.run([sys.executable, "-c", resolve, str(conf), *overrides], env=env, cwd=work,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"resolving the trainer config with {tree} failed:\n{proc.stderr[-3000:]}")
    return ["--resolved-config", proc.stdout]


def _run(tree: Path, work: Path, model: Path, cache: Path, *, keys: dict, updates: int, threads: int) -> dict:
    """Plan (with `tree`'s own planner and config, whose key names are `keys`) and train one stage under
    the probe; its figures."""
    env = {**C.child_env(), "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads),
           "MKL_NUM_THREADS": str(threads)}
    work.mkdir(parents=True)
    overrides = [f"model.path={model}", f"{keys['train_cache']}={cache}", f"{keys['val_cache']}=null",
                 "optim.global_batch=8",
                 "optim.micro_batch=8", "checkpoint.save_every=0", *C.BENCH_OVERRIDES]
    plan = [sys.executable, "-m", "pipeline", "plan", "--total-updates", str(updates), "--pilot-fraction", "0.5",
            "--num-chunks", "1", *_config_args(tree, env, work, overrides), "--export-weights", "raw",
            "--out-plan", str(work / "plan.json"), "--out-config", str(work / "train_config.yaml")]
    # cwd=work: `python -m` puts the working directory first on sys.path, and the repository root would
    # shadow `tree`'s package.
    proc = subprocess.run(plan, env=env, cwd=work, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"plan with {tree} failed:\n{proc.stderr[-3000:]}")
    p = json.loads((work / "plan.json").read_text())
    p["stages"] = [{"name": "all", "start": 0, "end": updates}]
    (work / "plan.json").write_text(json.dumps(p))
    cmd = [sys.executable, str(C.REPO / "bench" / "_peak.py"), str(work / "peak.json"), "--plan", str(work / "plan.json"),
           "--config", str(work / "train_config.yaml"), "--stage", "all", "--scratch", str(work / "scratch"),
           "--out", str(work / "out")]
    with open(work / "log.txt", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work, timeout=3600)
    if proc.returncode != 0:
        sys.exit(f"training with {tree} failed; log:\n{(work / 'log.txt').read_text()[-4000:]}")
    peak = json.loads((work / "peak.json").read_text())
    rows = [json.loads(x) for x in (work / "out" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    return {"update_peak_mb": max(u["rss_peak"] - u["rss_start"] for u in peak["updates"]) / 2**20,
            "process_peak_mb": peak["ru_maxrss"] / 2**20,
            "tokens_per_s": C.median(r["tokens_per_s"] for r in rows[1:]), "loss_1": rows[0]["loss"]}


def padding(root: Path) -> dict:
    """Padding fraction of the default run's micro-batches, sampled order vs grouped by length."""
    import yaml

    from pipeline.data.cache import TokenCache
    from pipeline.planning.order import RunSampler, padding_fraction

    workflow = yaml.safe_load((C.REPO / "config" / "config.yaml").read_text())
    default = C.build_default(root, max_length=workflow["data"]["max_length"])
    settings = dict(a.split("=") for a in workflow["train"]["overrides"] if a.startswith("optim."))
    global_batch, micro = int(settings["optim.global_batch"]), int(settings["optim.micro_batch"])
    total = workflow["schedule"]["total_updates"]
    lengths = TokenCache(default["train"]).lengths
    steps = range(total)
    return {"before": padding_fraction(RunSampler(len(lengths), global_batch, 0), lengths, steps, micro=micro),
            "after": padding_fraction(RunSampler(len(lengths), global_batch, 0, lengths=lengths), lengths, steps,
                                      micro=micro),
            "global_batch": global_batch, "micro_batch": micro, "updates": total, "records": int(len(lengths)),
            "mean_length": float(lengths.mean()), "max_length": int(lengths.max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default=BEFORE, help="git revision of the 'before' trainer")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--updates", type=int, default=4, help="updates per run (the first is excluded from tokens/s)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per record (8 records per update)")
    ap.add_argument("--out-dir", type=Path, default=C.RESULTS)
    C.add_smoke(ap)
    args = ap.parse_args()
    machine = C.machine()  # before we load the cores ourselves (imports torch: after --help)
    C.smoke(args, rounds=1, updates=2, seq_len=64)
    command = C.command_line(__file__)
    started = time.time()

    import bench_gpu

    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        tmp = Path(tmp)
        trees = {"before": _tree(args.before, tmp / "before"), "after": C.REPO}
        model = _model(tmp / "model")
        bench_gpu.build_cache(tmp / "train.safetensors", records=8 * args.updates, seq_len=args.seq_len,
                              vocab=SHAPE["vocab_size"])
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        loads = []
        for r in range(args.rounds):
            for name in (["before", "after"] if r % 2 == 0 else ["after", "before"]):
                loads.append(C.load_average())
                runs[name].append(_run(trees[name], tmp / f"{name}{r}", model, tmp / "train.safetensors",
                                       keys=BEFORE_KEYS if name == "before" else AFTER_KEYS,
                                       updates=args.updates, threads=args.threads))
                print(name, r, runs[name][-1], file=sys.stderr)
        pad = padding(tmp / "default")

    fig = {name: {k: C.median(x[k] for x in rs) for k in rs[0]} for name, rs in runs.items()}
    ratio = fig["after"]["update_peak_mb"] / fig["before"]["update_peak_mb"]
    versions = C.versions("torch", "transformers", "peft")
    data = {"name": "memory", "command": command, "date": C.today(), "machine": machine, "versions": versions,
            "trainer_commit": C.git_commit(), "before_commit": args.before, "wall_s": time.time() - started,
            "settings": {**vars(args), "out_dir": str(args.out_dir), "model": SHAPE, "micro_batch": 8},
            "figures": {"before": fig["before"], "after": fig["after"], "update_peak_ratio": ratio, "padding": pad},
            "per_round": runs, "load_average_per_run": loads}
    b, a = fig["before"], fig["after"]
    lines = [
        "# One update on a CPU before / after issue 13: peak memory, tokens/s; padding of the default data",
        "",
        f"Command: `{command}` (from the repository root); {C.today()}.",
        "",
        f"Machine: {C.machine_text(machine)}. Versions: {C.versions_text(versions)}; after = trainer at commit "
        f"{data['trainer_commit']}, before = trainer at commit {args.before}.",
        "",
        f"Model: Llama-style, vocabulary {SHAPE['vocab_size']:,}, hidden {SHAPE['hidden_size']}, "
        f"{SHAPE['num_hidden_layers']} layers, random init, fp32; LoRA and EMA defaults. One micro-batch of 8 x "
        f"{args.seq_len} tokens per update (the first quarter of each record unsupervised). {args.rounds} rounds of {args.updates} updates per "
        f"version, order alternated; {args.threads} torch thread(s). Method: bench/bench_memory.py's docstring.",
        "",
        "| figure | before | after | after / before | goal |",
        "|---|---:|---:|---:|---|",
        f"| peak memory of one update (RSS rise during the update) | {b['update_peak_mb']:,.0f} MB | "
        f"{a['update_peak_mb']:,.0f} MB | **{ratio:.2f}** | <= 0.5: {'met' if ratio <= 0.5 else 'NOT met'} |",
        f"| peak RSS of the whole stage process | {b['process_peak_mb']:,.0f} MB | {a['process_peak_mb']:,.0f} MB | "
        f"{a['process_peak_mb'] / b['process_peak_mb']:.2f} | |",
        f"| tokens/s (median, updates after the first) | {b['tokens_per_s']:,.0f} | {a['tokens_per_s']:,.0f} | "
        f"{a['tokens_per_s'] / b['tokens_per_s']:.2f} | |",
        f"| loss of update 1 (same model, data, seed) | {b['loss_1']:.6f} | {a['loss_1']:.6f} | | equal up to "
        "rounding |",
        f"| padding fraction of the default data ({pad['updates']} updates, batch {pad['global_batch']}, "
        f"micro-batch {pad['micro_batch']}; sampled order / grouped by length) | {100 * pad['before']:.1f}% | "
        f"{100 * pad['after']:.1f}% | {pad['after'] / pad['before']:.2f} | |",
        "",
        f"Default data: {pad['records']:,} records, mean length {pad['mean_length']:.1f} tokens, longest "
        f"{pad['max_length']}.",
        "",
        "Per round (MB of update peak; tokens/s):",
        "",
        *[f"- {name}: " + "; ".join(f"{x['update_peak_mb']:,.0f} MB, {x['tokens_per_s']:,.0f} tok/s" for x in rs)
          for name, rs in runs.items()],
    ]
    C.write_results("memory", lines, data, args.out_dir)


if __name__ == "__main__":
    main()
