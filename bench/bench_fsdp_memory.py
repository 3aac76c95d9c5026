"""Host memory of an FSDP run: every rank loading the whole base vs each rank reading its shards.

    python bench/bench_fsdp_memory.py [--models 16x1024 40x1024] [--rounds 2] [--checkpointing off|on]
    python bench/bench_fsdp_memory.py --smoke      # one 2x128 model, 1 round, to a temp dir: checks it runs

For each model (layers x hidden: Llama-style, vocabulary 32k, tied
embeddings, random weights in fp32 safetensors; 222M and 505M parameters by
default), trains 2 LoRA updates with `distributed.strategy=fsdp` on 2 gloo
ranks (CPU), twice: `distributed.meta_init=false` (each rank loads the whole
base, then shards it: the behaviour before) and `true` (each rank builds an
empty skeleton, shards it, reads only its rows of each tensor). While each run
lasts, the peak resident memory (VmHWM) of both rank processes is read from
/proc. The final shards of every run of a model are compared: they must be identical.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def build_model(root: Path, layers: int, hidden: int) -> tuple[Path, int]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.demo import text as demo

    tok = demo.build_tokenizer()
    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=int(hidden * 2.75),
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(config)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    return root / "model", n


def _rank_hwm(marker: str, seen: dict[int, int], stop: threading.Event) -> None:
    """Poll /proc for the ranks of one run: command line holds `marker`, environment LOCAL_RANK, and
    the parent is the run's torchrun agent (a rank's own children, e.g. compile workers forked with
    its command line and environment, are not ranks)."""
    while not stop.is_set():
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                if marker not in cmd or "torch.distributed.run" in cmd:
                    continue
                if b"LOCAL_RANK=" not in (proc / "environ").read_bytes():
                    continue
                parent = (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
                if b"torch.distributed.run" not in Path(f"/proc/{parent}/cmdline").read_bytes():
                    continue
                status = (proc / "status").read_text()
            except OSError:
                continue
            hwm = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM")), 0)
            seen[int(proc.name)] = max(seen.get(int(proc.name), 0), hwm)
        time.sleep(0.05)


def run(root: Path, default: dict, meta_init: bool, checkpointing: str) -> dict:
    work = root / f"meta_init_{meta_init}"
    plan = C.plan_run(work / "plan", default, total=2, single_stage=True, overrides=[
        "distributed=fsdp", f"distributed.meta_init={str(meta_init).lower()}", "optim.global_batch=4",
        "optim.micro_batch=2", "ema.rates=[0.99]", f"{C.KEY_EVAL_EVERY}=0", "checkpoint.save_every=0",
        "checkpoint.async_save=false", f"model.activation_checkpointing={checkpointing}"])
    out = work / "stage"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "pipeline",
           "train", "--plan", str(plan["plan"]), "--config", str(plan["config"]), "--stage", "all",
           "--scratch", str(work / "scratch"), "--out", str(out)]
    seen: dict[int, int] = {}
    stop = threading.Event()
    poller = threading.Thread(target=_rank_hwm, args=(str(work / "scratch"), seen, stop))
    poller.start()
    started = time.time()
    try:
        C.run_child(cmd, work, threads=1, label=f"meta_init={meta_init}")
    finally:
        stop.set()
        poller.join()
    shards = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
              for p in sorted((out / "checkpoint" / "dcp").glob("__*.distcp"))}
    return {"rank_peak_rss_mb": sorted(v / 1024 for v in seen.values()), "seconds": time.time() - started,
            "shards": shards}


LOADS = {False: "every rank loads the whole base (`meta_init=false`, before)",
         True: "each rank reads its shards (`meta_init=true`, default)"}


def measure(root: Path, default: dict, layers: int, hidden: int, rounds: int, checkpointing: str) -> dict:
    default = {**default}
    default["model"], params = build_model(root, layers, hidden)
    model_mb = sum(p.stat().st_size for p in default["model"].glob("*.safetensors")) / 2**20
    runs = [{meta: run(root / f"round{i}", default, meta, checkpointing) for meta in LOADS} for i in range(rounds)]
    for meta, r in ((meta, r) for rnd in runs for meta, r in rnd.items()):
        if len(r["rank_peak_rss_mb"]) != 2:
            sys.exit(f"{layers}x{hidden}, meta_init={meta}: expected 2 rank processes, saw {r['rank_peak_rss_mb']}")
    ratios = [max(rnd[True]["rank_peak_rss_mb"]) / max(rnd[False]["rank_peak_rss_mb"]) for rnd in runs]
    shards = {json.dumps(r["shards"], sort_keys=True) for rnd in runs for r in rnd.values()}
    return {"shape": f"{layers}x{hidden}", "params": params, "model_mb": model_mb, "ratios": ratios,
            "ratio": max(ratios), "identical": len(shards) == 1,
            "rounds": [{f"meta_init={meta}": r for meta, r in rnd.items()} for rnd in runs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["16x1024", "40x1024"], help="layers x hidden, one per model")
    ap.add_argument("--rounds", type=int, default=2, help="before/after pairs per model")
    ap.add_argument("--checkpointing", choices=["off", "on"], default="off",
                    help="model.activation_checkpointing in both runs (on: results in fsdp_memory_checkpointing.md)")
    ap.add_argument("--out-dir", type=Path, default=C.RESULTS)
    C.add_smoke(ap)
    args = ap.parse_args()
    C.smoke(args, models=["2x128"], rounds=1)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_fsdp_memory_") as tmp:
        default = C.build_default(Path(tmp) / "default")  # the demo tokenizer and token caches
        for shape in args.models:
            layers, hidden = (int(x) for x in shape.split("x"))
            with tempfile.TemporaryDirectory(prefix=f"{shape}_", dir=tmp) as root:
                results.append(measure(Path(root), default, layers, hidden, args.rounds, args.checkpointing))
    machine = C.machine()
    md = [
        "# FSDP host memory: whole-model load vs sharded load",
        "",
        f"Command: `{C.command_line(__file__)}`",
        f"Machine: {C.machine_text(machine)}",
        "",
        "Models: Llama-style, vocabulary 32k, tied embeddings, fp32 safetensors; LoRA, 2 updates, "
        "`distributed.strategy=fsdp`, 2 gloo ranks on the CPU, default malloc, "
        f"activation checkpointing {args.checkpointing}.",
        "",
        "| model (layers x hidden) | parameters | weights (MiB) | round | load | peak RSS per rank (MiB) | wall time (s) |",
        "|---|---|---|---|---|---|---|",
        *(f"| {m['shape']} | {m['params'] / 1e6:.0f}M | {m['model_mb']:,.0f} | {i + 1} | {LOADS[meta]} "
          f"| {', '.join(f'{x:,.0f}' for x in r['rank_peak_rss_mb'])} | {r['seconds']:.1f} |"
          for m in results for i, rnd in enumerate(m["rounds"])
          for meta, r in ((meta, rnd[f"meta_init={meta}"]) for meta in LOADS)),
        "",
        "Largest rank's peak, after / before, by round (the worst round counts): " + "; ".join(
            f"**{m['ratio']:.3f}x** at {m['params'] / 1e6:.0f}M parameters "
            f"({', '.join(f'{r:.3f}' for r in m['ratios'])})" for m in results) + " (goal <= 0.6x).",
        "Final shards " + "; ".join(f"{'bit-identical' if m['identical'] else 'DIFFER'} at {m['shape']}" for m in results)
        + " (every round, whole load and sharded load).",
        "",
        "Where the memory goes (per rank, anonymous RSS by phase, from a probe reading /proc in runs with these",
        "settings, activation checkpointing off): about 320-360 MiB of runtime (torch, transformers, peft, the",
        "adapter) in both loads. Before, the peak is the load: the whole base mapped from its file, plus the",
        "rank's new shards while `fully_shard` cuts them. After, it is an update: the rank's shards (437 MiB",
        "at 222M, 995 MiB at 505M)",
        "plus the update's working memory (activations kept for the backward, each unit's all-gathered",
        "weights, the root unit's being the tied 32k x 1024 embeddings), +360-390 MiB at 16 layers and",
        "+540-670 MiB at 40. Both runs train alike; the copy of the base that the sharded load saves grows",
        "with the model faster than that working memory, so the ratio falls as the model grows.",
        *(["With activation checkpointing on, each decoder layer keeps only its input for the backward: the",
           "update's working memory, and so the after peak, is lower; the before peak (the load) is not."]
          if args.checkpointing == "on" else []),
        "",
        "The sharded load pins glibc's mmap threshold (`sharded_load.pin_mmap_threshold`): freeing",
        "the skeleton's blocks would otherwise raise it, and each forward's freed buffers would stay",
        "resident on the heap (measured before the pin, 222M: 2,269 MiB after vs 1,761 MiB before, 1.29x).",
    ]
    data = {"command": C.command_line(__file__), "date": C.today(), "machine": machine, "trainer_commit": C.git_commit(),
            "versions": C.versions("torch", "transformers", "peft"), "checkpointing": args.checkpointing,
            "figures": results}
    C.write_results("fsdp_memory" + ("_checkpointing" if args.checkpointing == "on" else ""), md, data, args.out_dir)


if __name__ == "__main__":
    main()
