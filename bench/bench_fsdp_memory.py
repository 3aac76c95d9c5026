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
    """Poll /proc for the ranks of one run (their command line holds `marker`, not torchrun's)."""
    while not stop.is_set():
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                if marker not in cmd or "torch.distributed.run" in cmd or "pipeline train" not in cmd:
                    continue
                status = (proc / "status").read_text()
            except OSError:
                continue
            hwm = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM")), 0)
            seen[int(proc.name)] = max(seen.get(int(proc.name), 0), hwm)
        time.sleep(0.05)


def run(root: Path, default: dict, meta_init: bool) -> dict:
    work = root / f"meta_init_{meta_init}"
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
        C.run_child(cmd, work, threads=1, label=f"meta_init={meta_init}")
    finally:
        stop.set()
        poller.join()
    shards = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
              for p in sorted((out / "checkpoint" / "dcp").glob("__*.distcp"))}
    return {"rank_peak_rss_mb": sorted(v / 1024 for v in seen.values()), "seconds": time.time() - started,
            "shards": shards}


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
        before = run(root, default, meta_init=False)
        after = run(root, default, meta_init=True)
    if len(before["rank_peak_rss_mb"]) != 2 or len(after["rank_peak_rss_mb"]) != 2:
        sys.exit(f"expected 2 rank processes, saw {before['rank_peak_rss_mb']} / {after['rank_peak_rss_mb']}")
    ratio = max(after["rank_peak_rss_mb"]) / max(before["rank_peak_rss_mb"])
    identical = before["shards"] == after["shards"]
    figures = {"params": params, "model_mb": model_mb, "before": before, "after": after,
               "ratio_max_rank": ratio, "identical": identical}
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
        "| load | peak RSS per rank (MiB) | wall time (s) |",
        "|---|---|---|",
        f"| every rank loads the whole base (`distributed.meta_init=false`, before) | "
        f"{', '.join(f'{x:,.0f}' for x in before['rank_peak_rss_mb'])} | {before['seconds']:.1f} |",
        f"| each rank reads its shards (`distributed.meta_init=true`, default) | "
        f"{', '.join(f'{x:,.0f}' for x in after['rank_peak_rss_mb'])} | {after['seconds']:.1f} |",
        "",
        f"Largest rank, after / before: **{ratio:.2f}x** (goal <= 0.6x). Final shards "
        f"{'bit-identical' if identical else 'DIFFER'} between the two runs.",
    ]
    data = {"command": C.command_line(__file__), "date": C.today(), "machine": machine,
            "versions": C.versions("torch", "transformers", "peft"), "figures": figures}
    C.write_results("fsdp_memory", md, data)


if __name__ == "__main__":
    main()
