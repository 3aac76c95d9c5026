"""Host memory of an FSDP run: every rank loading the whole base vs each rank reading its shards.

    python bench/bench_fsdp_memory.py [--layers 16] [--hidden 1024]

Builds a Llama-style model of a few hundred million parameters (random
weights, fp32 safetensors), then trains 2 LoRA updates with
`distributed.strategy=fsdp` on 2 gloo ranks (CPU), twice:
`distributed.meta_init=false` (each rank loads the whole base, then shards it:
the behaviour before) and `true` (each rank builds an empty skeleton, shards
it, reads only its rows of each tensor). While each run lasts, the peak
resident memory (VmHWM) of both rank processes is read from /proc. The two
runs must end with identical shards.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def build_model(root: Path, layers: int, hidden: int) -> tuple[Path, int]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline import demo

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
    """Poll /proc for the ranks of one run: command line holds `marker`, environment LOCAL_RANK."""
    while not stop.is_set():
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                if marker not in cmd or "torch.distributed.run" in cmd:
                    continue
                if b"LOCAL_RANK=" not in (proc / "environ").read_bytes():
                    continue
                status = (proc / "status").read_text()
            except OSError:
                continue
            hwm = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM")), 0)
            seen[int(proc.name)] = max(seen.get(int(proc.name), 0), hwm)
        time.sleep(0.05)


def run(root: Path, default: dict, meta_init: bool, malloc_env: dict) -> dict:
    work = root / f"meta_init_{meta_init}_{bool(malloc_env)}"
    plan = C.plan_run(work / "plan", default, total=2, single_stage=True, overrides=[
        "distributed=fsdp", f"distributed.meta_init={str(meta_init).lower()}", "optim.global_batch=4",
        "optim.micro_batch=2", "ema.rates=[0.99]", "eval.eval_every=0", "checkpoint.save_every=0",
        "checkpoint.async_save=false"])
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
        C.run_child(cmd, work, threads=1, label=f"meta_init={meta_init}", extra_env=malloc_env)
    finally:
        stop.set()
        poller.join()
    shards = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
              for p in sorted((out / "checkpoint" / "dcp").glob("__*.distcp"))}
    return {"rank_peak_rss_mb": sorted(v / 1024 for v in seen.values()), "seconds": time.time() - started,
            "shards": shards}


MALLOC = {"default": {}, "MALLOC_MMAP_THRESHOLD_=65536": {"MALLOC_MMAP_THRESHOLD_": "65536"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_fsdp_memory_") as tmp:
        root = Path(tmp)
        default = C.build_default(root / "default")  # the demo tokenizer and token caches
        default["model"], params = build_model(root, args.layers, args.hidden)
        model_mb = sum(p.stat().st_size for p in default["model"].glob("*.safetensors")) / 2**20
        results = {(meta, name): run(root, default, meta, env) for name, env in MALLOC.items()
                   for meta in (False, True)}
    for key, r in results.items():
        if len(r["rank_peak_rss_mb"]) != 2:
            sys.exit(f"{key}: expected 2 rank processes, saw {r['rank_peak_rss_mb']}")
    ratios = {name: max(results[(True, name)]["rank_peak_rss_mb"]) / max(results[(False, name)]["rank_peak_rss_mb"])
              for name in MALLOC}
    identical = len({json.dumps(r["shards"], sort_keys=True) for r in results.values()}) == 1
    figures = {"params": params, "model_mb": model_mb, "ratios": ratios, "identical": identical,
               "runs": {f"meta_init={meta}, malloc={name}": r for (meta, name), r in results.items()}}
    machine = C.machine()
    md = [
        "# FSDP host memory: whole-model load vs sharded load",
        "",
        f"Command: `{C.command_line(__file__)}`",
        f"Machine: {C.machine_text(machine)}",
        "",
        f"Model: Llama-style, {params / 1e6:.0f}M parameters, {model_mb:,.0f} MiB of fp32 safetensors; "
        "LoRA, 2 updates, `distributed.strategy=fsdp`, 2 gloo ranks on the CPU.",
        "",
        "| load | malloc | peak RSS per rank (MiB) | wall time (s) |",
        "|---|---|---|---|",
        *(f"| {'each rank reads its shards (`meta_init=true`, default)' if meta else 'every rank loads the whole base (`meta_init=false`, before)'} "
          f"| {name} | {', '.join(f'{x:,.0f}' for x in r['rank_peak_rss_mb'])} | {r['seconds']:.1f} |"
          for (meta, name), r in results.items()),
        "",
        "Largest rank's peak, after / before: " + "; ".join(f"**{ratios[n]:.2f}x** with {n} malloc" for n in MALLOC)
        + f" (goal <= 0.6x). Final shards {'bit-identical' if identical else 'DIFFER'} across all runs.",
        "",
        "Why two malloc settings: glibc keeps freed heap memory mapped, so transient buffers (each layer's",
        "all-gather, the evaluation's activations) stay in the resident set after they are freed and hide",
        "what is live. `MALLOC_MMAP_THRESHOLD_=65536` serves allocations over 64 KiB with mmap, returned",
        "to the system when freed: the peak then shows live memory. Both loads run under both settings.",
    ]
    data = {"command": C.command_line(__file__), "date": C.today(), "machine": machine,
            "versions": C.versions("torch", "transformers", "peft"), "figures": figures}
    C.write_results("fsdp_memory", md, data)


if __name__ == "__main__":
    main()
