"""CPU benchmark (GPU issue): one training step's forward + backward, padded batches with the attention mask
(before) and without it (after, `pipeline.model.loss.MASK_FREE_FAMILIES`); same loss and gradients?

    python bench/bench_step.py                # 5 rounds on a small Llama (vocab 32k), one torch thread
    python bench/bench_step.py --rounds 9
    python bench/bench_step.py --smoke        # tiny model, 1 round: checks it runs

In this process: a Llama-style model (vocab 32,000, hidden 256, 4 layers, 4
query heads sharing 2 K/V heads (GQA), intermediate 688, untied head; random
init, fp32, SDPA), all parameters trained, one right-padded micro-batch of 8
records of 128..512 tokens (the first 64 of each unsupervised, a prompt),
through `TokenLoss` as the trainer calls it: decoder, then the chunked LM head
+ cross-entropy over the supervised positions. The arms, interleaved and their
order rotated every round, one warm-up step each first:
  masked     the attention mask sent with the padded batch (the trainer before)
  mask-free  no mask (the trainer now, for a Llama)
Figures: |difference| of the mean loss per supervised token (the trainer's
normalization) and max |difference| of every parameter's gradient of it,
mask-free vs masked; tokens/s = real (non-padding) tokens / step time, median
over rounds, by the wall clock and by the process CPU-time clock (less moved
by other jobs on a shared machine). The loss chunk is the eager `_chunk_loss` on a CPU in both arms and
before this change alike (`chunk_loss_for`; the compiled one is CUDA's): the
loss path's CPU figures are unchanged by construction, and checked here by
identity. Nothing here measures a GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

ARMS = ("masked", "mask-free")


def build(args):
    import torch
    import transformers as tf

    from pipeline.data.cache import IGNORE_INDEX
    from pipeline.model.loss import collate

    config = tf.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                            num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=args.max_len, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).float()
    g = torch.Generator().manual_seed(1)
    records = []
    for _ in range(args.batch):
        n = int(torch.randint(args.min_len, args.max_len + 1, (1,), generator=g))
        ids = torch.randint(1, args.vocab, (n,), generator=g)
        labels = ids.clone()
        labels[:args.prompt] = IGNORE_INDEX
        records.append((ids, labels))
    return model, collate(records, list(range(len(records))), pad_id=0)


def step(loss_model, batch):
    """One forward + backward of the mean loss per supervised token (what the trainer's gradient is);
    (seconds, mean loss, gradients)."""
    loss_model.zero_grad(set_to_none=True)
    t0, c0 = time.perf_counter(), time.process_time()
    loss = loss_model(batch) / batch.supervised
    loss.backward()
    seconds = (time.perf_counter() - t0, time.process_time() - c0)
    grads = {n: p.grad.detach().clone() for n, p in loss_model.lm.named_parameters() if p.grad is not None}
    return seconds, loss.detach(), grads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out-dir", type=Path, default=C.RESULTS)
    C.add_smoke(ap)
    args = ap.parse_args()
    shape = dict(vocab=32000, hidden=256, intermediate=688, layers=4, batch=8, min_len=128, max_len=512, prompt=64)
    tiny = dict(vocab=1000, hidden=64, intermediate=128, layers=2, batch=4, min_len=16, max_len=48, prompt=4)
    for key, value in shape.items():
        setattr(args, key, value)
    C.smoke(args, rounds=1, **tiny)

    import torch

    from pipeline.model.loss import TokenLoss, _chunk_loss, chunk_loss_for

    torch.set_num_threads(args.threads)
    model, batch = build(args)
    assert "attention_mask" in batch.inputs, "the batch must be padded for the comparison to mean anything"
    arms = {"masked": TokenLoss(model, mask_free=False), "mask-free": TokenLoss(model, mask_free=True)}
    assert arms["mask-free"].mask_free == TokenLoss(model).mask_free  # what the trainer does for a Llama
    results = {arm: step(arms[arm], batch) for arm in ARMS}  # warm-up, and the figures compared
    loss_diff = float((results["mask-free"][1] - results["masked"][1]).abs())
    grads = results["masked"][2]
    grad_diff = max(float((results["mask-free"][2][n] - g).abs().max()) for n, g in grads.items())
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    cpu: dict[str, list[float]] = {arm: [] for arm in ARMS}
    load_start = C.load_average()
    for r in range(args.rounds):
        order = ARMS[r % 2:] + ARMS[:r % 2]
        for arm in order:
            wall, used = step(arms[arm], batch)[0]
            seconds[arm].append(wall)
            cpu[arm].append(used)
    tokens = batch.tokens
    tps = {arm: tokens / C.median(seconds[arm]) for arm in ARMS}
    tps_cpu = {arm: tokens / C.median(cpu[arm]) for arm in ARMS}
    width = batch.inputs["input_ids"].shape[1]
    machine = C.machine()
    md = [
        "# One step, padded batch: attention mask vs none",
        "",
        f"Command: `{C.command_line(__file__)}`",
        f"Machine: {C.machine_text(machine)}",
        "",
        f"Llama-style model, vocab {args.vocab:,}, hidden {args.hidden}, {args.layers} layers, 4 heads / 2 K/V heads, "
        f"fp32, SDPA, every parameter trained; one micro-batch of {args.batch} records ({tokens:,} real tokens, "
        f"padded to {args.batch} x {width} = {args.batch * width:,}; {batch.supervised:,} supervised); "
        f"{args.threads} torch thread(s); median of {args.rounds} rounds (interleaved, order rotated).",
        "",
        "| arm | step time (s), median | min..max | tokens/s | process CPU time (s), median | tokens per CPU s |",
        "|---|---|---|---|---|---|",
        *(f"| {arm} | {C.median(seconds[arm]):.3f} | {min(seconds[arm]):.3f}..{max(seconds[arm]):.3f} | "
          f"{tps[arm]:,.0f} | {C.median(cpu[arm]):.3f} | {tps_cpu[arm]:,.0f} |" for arm in ARMS),
        "",
        f"mask-free vs masked, mean loss per supervised token (the trainer's normalization): "
        f"{float(results['masked'][1]):.7f} vs {float(results['mask-free'][1]):.7f}, |diff| **{loss_diff:.3g}**; "
        f"gradients max |diff| **{grad_diff:.3g}** over {len(grads)} tensors (largest gradient entry "
        f"{max(float(g.abs().max()) for g in grads.values()):.3g}).",
        f"Loss chunk on the CPU: `chunk_loss_for(cpu) is _chunk_loss`: "
        f"{chunk_loss_for(torch.device('cpu')) is _chunk_loss} (the eager function of before: unchanged).",
    ]
    data = {"command": C.command_line(__file__), "date": C.today(), "machine": machine,
            "trainer_commit": C.git_commit(), "versions": C.versions("torch", "transformers"),
            "load_during": [load_start[0], C.load_average()[0]] if load_start else None,
            "figures": {"tokens_per_s": tps, "tokens_per_cpu_s": tps_cpu, "seconds": seconds, "cpu_seconds": cpu,
                        "loss_diff": loss_diff, "grad_diff": grad_diff,
                        "tokens": tokens,
                        "cpu_loss_path_unchanged": chunk_loss_for(torch.device("cpu")) is _chunk_loss}}
    C.write_results("step", md, data, args.out_dir)


if __name__ == "__main__":
    main()
