"""The fused settings against the default, on a CPU: tokens/s and peak memory of LoRA training steps.

    python bench/bench_kernels.py                 # Llama-style 4 x 512 model, 32k vocabulary, micro-batch 4 x 256
    python bench/bench_kernels.py --smoke         # tiny sizes: only checks that the path runs

Arms (the same model, batch and seed; each a fresh child process per round, so each has its own peak RSS):

  default       lora.dropout=0 (the default), the chunked loss (model.fused_loss=auto on a CPU)
  dropout 0.05  the former default: peft's dropout on every adapter's input
  lora.fused    one addmm per LoRA layer (pipeline/model/kernels.py)
  fused loss    model.fused_loss's wiring with the torch fallback of the kernels' contract: on a CPU
                there is no Liger / cut-cross-entropy kernel (Triton, CUDA), so this arm computes
                full logits; it measures the wiring, not the kernels (bench/gpu_check.sh does, on a GPU)

A step is TokenLoss forward + backward + AdamW on the LoRA weights, fp32, one torch thread by default.
The arms run in rounds, interleaved, the order rotated each round, so that other jobs on a shared
machine weigh on every arm alike. Per arm: tokens (non-padding) per second of wall clock and per
second of the process's CPU time (the figure other jobs disturb least), each the median over every
timed step of every round; peak memory as the process's peak RSS and as the rise of RSS over the
timed steps above the RSS just before them (activations, logits, gradients, optimizer state).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

ARMS = {"default": [], "dropout 0.05": ["lora.dropout=0.05"], "lora.fused": ["lora.fused=true"],
        "fused loss": ["model.fused_loss=liger"]}
SHAPES = {"full": dict(hidden_size=512, num_hidden_layers=4, intermediate_size=1376, num_attention_heads=8,
                       num_key_value_heads=4, vocab_size=32000),
          "tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512)}


def child(arm: str, args) -> dict:
    """One arm in this process: the steps, timed; returns its figures."""
    import torch
    from omegaconf import OmegaConf
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline import config as train_config
    from pipeline.model import kernels, loading
    from pipeline.model.loss import TokenLoss, collate

    torch.set_num_threads(args.threads)
    overrides = ARMS[arm]
    cfg = train_config.to_typed(OmegaConf.from_dotlist(["model.path=bench", "tokens.train_cache=t", *overrides]))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPES[args.shape], attn_implementation="sdpa"))
    model = loading.attach_lora(model, cfg).train()
    if cfg.model.fused_loss == "liger":  # the torch fallback in the kernel's place (no Triton on a CPU)
        kernels.FUSED_LOSSES["liger"] = kernels.torch_linear_cross_entropy
    loss_model = TokenLoss(model, fused_loss=cfg.model.fused_loss)
    optimizer = torch.optim.AdamW([p for _, p in loading.trainable(model)], lr=1e-4)
    g = torch.Generator().manual_seed(1)
    vocab = SHAPES[args.shape]["vocab_size"]
    records = []
    for _ in range(args.micro_batch):
        ids = torch.randint(3, vocab, (args.length,), generator=g)
        labels = ids.clone()
        labels[: args.length // 8] = -100  # a prompt
        records.append((ids, labels))
    batch = collate(records, list(range(len(records))), 0)
    walls, cpus = [], []
    rss_before = _rss_mb()
    for step in range(args.warmup + args.steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = loss_model(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= args.warmup:
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - start_cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"arm": arm, "overrides": overrides, "tokens": batch.tokens, "supervised": batch.supervised,
            "loss_chunk_rows": loss_model.chunk, "step_s": walls, "step_cpu_s": cpus,
            "peak_rss_mb": peak, "step_rss_rise_mb": peak - rss_before,
            "fused_loss": getattr(loss_model.fused, "__name__", None), "final_loss": float(loss)}


def _rss_mb() -> float:
    """This process's resident set now (MB), from /proc/self/statm."""
    import os

    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _summary(name: str, runs: list[dict]) -> dict:
    """One arm's rounds: medians over every timed step, the spread of the rounds' medians, peaks."""
    tokens = runs[0]["tokens"]
    walls = [t for r in runs for t in r["step_s"]]
    cpus = [t for r in runs for t in r["step_cpu_s"]]
    return {"arm": name, "overrides": runs[0]["overrides"], "tokens_per_step": tokens,
            "supervised_per_step": runs[0]["supervised"], "loss_chunk_rows": runs[0]["loss_chunk_rows"],
            "tokens_per_s": tokens / statistics.median(walls), "tokens_per_cpu_s": tokens / statistics.median(cpus),
            "rounds_tokens_per_s": [tokens / statistics.median(r["step_s"]) for r in runs],
            "rounds_tokens_per_cpu_s": [tokens / statistics.median(r["step_cpu_s"]) for r in runs],
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
            "step_rss_rise_mb": statistics.median(r["step_rss_rise_mb"] for r in runs),
            "final_loss": runs[0]["final_loss"], "fused_loss": runs[0]["fused_loss"], "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="full")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", choices=list(ARMS), help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", type=Path, default=C.RESULTS)
    C.add_smoke(ap)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    machine = C.machine()
    command = C.command_line(__file__)
    C.smoke(args, shape="tiny", micro_batch=2, length=32, steps=2, warmup=1, rounds=1)
    names, runs, loads = list(ARMS), {arm: [] for arm in ARMS}, []
    for r in range(args.rounds):
        loads.append(C.load_average())
        for arm in names[r % len(names):] + names[:r % len(names)]:  # rotated: no arm always first
            cmd = [sys.executable, __file__, "--child", arm, "--shape", args.shape,
                   "--micro-batch", str(args.micro_batch), "--length", str(args.length), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--threads", str(args.threads)]
            env = {**C.child_env(), "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
            if proc.returncode != 0:
                sys.exit(f"arm {arm} failed:\n{proc.stderr[-4000:]}")
            runs[arm].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}/{args.rounds} {arm}: {runs[arm][-1]['tokens'] / statistics.median(runs[arm][-1]['step_cpu_s']):,.0f} "
                  "tokens per CPU s", file=sys.stderr, flush=True)
    loads.append(C.load_average())
    arms = [_summary(arm, runs[arm]) for arm in names]
    data = {"name": "kernels", "command": command, "date": C.today(), "machine": machine,
            "versions": C.versions("torch", "transformers", "peft"), "trainer_commit": C.git_commit(),
            "settings": {k: v for k, v in vars(args).items() if k != "out_dir"}, "shape": SHAPES[args.shape],
            "load_average_per_round": loads, "arms": arms}
    C.write_results("kernels", _table(data, args), data, args.out_dir)


def _table(data: dict, args) -> list[str]:
    arms, base = data["arms"], data["arms"][0]
    one_min = [x[0] for x in data["load_average_per_round"] if x]
    lines = ["# Fused settings against the default (CPU, fp32, LoRA r=16 on all seven projections)", "",
             f"Command: `{data['command']}` (from the repository root); {data['date']}.", "",
             f"Machine: {C.machine_text(data['machine'])}; the 1-minute load average was "
             f"{min(one_min):.1f}..{max(one_min):.1f} at the rounds' starts (a shared machine: the wall-clock "
             "figures carry that load, the CPU-time ones much less). Versions: "
             f"{C.versions_text(data['versions'])}; trainer at commit {data['trainer_commit']}.", "",
             f"Model: Llama-style {data['shape']}, random init, SDPA; micro-batch {args.micro_batch} x {args.length} "
             f"tokens; {args.rounds} rounds (arms interleaved, order rotated), each arm a fresh process per round "
             f"with {args.warmup} warmup + {args.steps} timed steps; {args.threads} torch thread(s). A step: "
             "forward, backward, AdamW on the LoRA weights. Medians over every timed step; [min..max] of the "
             "rounds' medians.", "",
             "| arm | overrides | tokens per CPU s | vs default | tokens/s (wall) | vs default | peak RSS (MB) "
             "| RSS rise over the steps (MB) | vs default |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for a in arms:
        lines.append(
            f"| {a['arm']} | {' '.join(a['overrides']) or '-'} | {a['tokens_per_cpu_s']:,.0f} "
            f"[{C.spread(a['rounds_tokens_per_cpu_s'])}] | {a['tokens_per_cpu_s'] / base['tokens_per_cpu_s']:.2f}x | "
            f"{a['tokens_per_s']:,.0f} [{C.spread(a['rounds_tokens_per_s'])}] | "
            f"{a['tokens_per_s'] / base['tokens_per_s']:.2f}x | {a['peak_rss_mb']:,.0f} | "
            f"{a['step_rss_rise_mb']:,.0f} | {a['step_rss_rise_mb'] - base['step_rss_rise_mb']:+,.0f} |")
    lines += ["", "Final loss of each arm's first round (same seed, same batch): "
              + ", ".join(f"{a['arm']} {a['final_loss']:.6f}" for a in arms) + ".", "",
              "The fused-loss arm runs the torch fallback in the kernel's place (no Triton kernel runs on a CPU): "
              "its figures are those of a full-logits loss, not of Liger's or cut-cross-entropy's kernels, which "
              "never write the logits. The default's chunked loss takes chunks of "
              f"{base['loss_chunk_rows']:,} rows; here {base['supervised_per_step']:,} supervised tokens a step "
              f"make {-(-base['supervised_per_step'] // base['loss_chunk_rows'])} chunk(s), whose logits it "
              "computes again in the backward (that recompute is what bounds its memory on long batches); the "
              "full-logits fallback keeps them instead. lora.fused skips the dropout's copy of each adapted "
              "layer's input and one add per layer; what either does on a GPU is for bench/gpu_check.sh to say."]
    return lines


if __name__ == "__main__":
    main()
