"""How many ops the host dispatches for one micro-batch of Llama-3.2-1B's structure under LoRA, peft vs lora.fused.

    python bench/bench_host_ops.py            # 16 layers (Llama-3.2-1B's depth), 20 timed micro-batches per arm
    python bench/bench_host_ops.py --smoke    # 2 layers, 2 timed micro-batches: checks it runs

Issue 32's H200 run left ~0.47 s per update that does not grow with its tokens; one hypothesis is that
the host cannot issue the work fast enough. On a GPU each op that computes is at least one kernel
launch, so the number of such ops per micro-batch bounds the host's share from below. This counts
them on the CPU, where the count is the same: Llama-3.2-1B's structure (16 decoder layers, GQA,
SwiGLU, tied head) at a width of 64, where the arithmetic is negligible, LoRA r=16 on all seven
projections, dropout 0, one micro-batch of 4 x 64 tokens through forward (the model's own loss) and
backward, fp32, one thread. Counted: the profiler's top-level aten ops (those not called by another
aten op), and of them the ones that compute (view, reshape, transpose, empty and similar ops launch
no kernel). The host time per op is this CPU's, which also did the (tiny) arithmetic; it is not a
GPU's launch cost. Arms: peft's LoRA forward, and `lora.fused` (pipeline.model.kernels.fuse_lora).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

# Ops that launch no kernel on a GPU (metadata, allocation, dispatch wrappers whose work is the ops they call).
NO_KERNEL = {"aten::view", "aten::reshape", "aten::t", "aten::transpose", "aten::expand", "aten::unsqueeze",
             "aten::squeeze", "aten::slice", "aten::select", "aten::as_strided", "aten::_unsafe_view",
             "aten::detach", "aten::alias", "aten::permute", "aten::split", "aten::chunk", "aten::contiguous",
             "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::lift_fresh", "aten::to",
             "aten::_to_copy", "aten::flatten", "aten::narrow", "aten::unbind", "aten::view_as",
             "aten::split_with_sizes", "aten::result_type", "aten::is_nonzero", "aten::item",
             "aten::_local_scalar_dense", "aten::numpy_T", "aten::matmul", "aten::linear", "aten::dropout"}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def measure(layers: int, fused: bool, timed: int) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=1,
                      head_dim=16, intermediate_size=256, vocab_size=512, tie_word_embeddings=True)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                             target_modules=TARGETS))
    adapted = 0
    if fused:
        from pipeline.model.kernels import fuse_lora

        adapted = fuse_lora(model)
    ids = torch.randint(0, cfg.vocab_size, (4, 64))

    def micro_batch():
        model(input_ids=ids, labels=ids).loss.backward()

    for _ in range(3):
        micro_batch()
    started = time.perf_counter()
    for _ in range(timed):
        micro_batch()
    seconds = (time.perf_counter() - started) / timed
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        micro_batch()
    top = [e.name for e in prof.events() if e.name.startswith("aten::")
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    computing = Counter(n for n in top if n not in NO_KERNEL)
    return {"arm": "lora.fused" if fused else "peft", "fused_layers": adapted, "ms_per_micro_batch": 1e3 * seconds,
            "top_level_ops": len(top), "computing_ops": sum(computing.values()),
            "us_per_top_level_op": 1e6 * seconds / len(top), "most_common": computing.most_common(8)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--timed", type=int, default=20)
    ap.add_argument("--out-dir", type=Path, default=C.RESULTS)
    C.add_smoke(ap)
    args = ap.parse_args()
    C.smoke(args, layers=2, timed=2)
    machine, command = C.machine(), C.command_line(__file__)
    import torch

    torch.set_num_threads(1)
    rows = [measure(args.layers, fused, args.timed) for fused in (False, True)]
    lines = [f"# Host ops per micro-batch, Llama-3.2-1B's structure at width 64, LoRA r=16 x 7 ({C.today()})", "",
             f"`{command}` at commit {C.git_commit()}. {C.machine_text(machine)}. "
             f"{args.layers} layers, one micro-batch of 4 x 64 tokens, forward + backward, fp32, one thread; "
             "see the script's docstring.", "",
             "| arm | ops that compute | top-level aten ops | ms per micro-batch (this CPU) | µs per top-level op "
             "| most common |",
             "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        common = ", ".join(f"{n.removeprefix('aten::')} {k}" for n, k in r["most_common"])
        lines.append(f"| {r['arm']} | {r['computing_ops']:,} | {r['top_level_ops']:,} | {r['ms_per_micro_batch']:.1f} "
                     f"| {r['us_per_top_level_op']:.1f} | {common} |")
    data = {"rows": rows, "layers": args.layers, "machine": machine, "command": command, "date": C.today(),
            "trainer_commit": C.git_commit(), "versions": C.versions("torch", "transformers", "peft")}
    C.write_results("host_ops", lines, data, args.out_dir)


if __name__ == "__main__":
    main()
