"""On a CUDA GPU: the checks of issue 32 that need one, each a PASS / FAIL line and a JSON record.

    python bench/gpu_kernels_check.py --out OUT.json      # bench/gpu_check.sh runs it
    python bench/gpu_kernels_check.py --smoke --out OUT.json   # on a CPU, fp32: the checks that need no CUDA
                                                             # (3, 4, 6), so the script's own path is tested

1. host syncs: a mask-free TokenLoss forward + backward with torch.cuda.set_sync_debug_mode("warn"): 0 syncs;
2. the compiled chunk loss: micro-batches with different supervised counts compile one graph;
3. lora.fused against peft's forward, bf16 autocast: loss and gradients;
4. model.fused_loss=liger / cce (where installed) against the chunked loss: loss and gradients;
5. model.liger_kernels (where installed) against the plain decoder: loss and gradients;
6. activation checkpointing through pipeline.compat on this transformers; the DCP stager probe.
Tolerances: fp32 1e-4 relative; bf16 3e-2 relative (of the largest gradient), loss 1e-2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from pipeline import compat  # noqa: E402
from pipeline import config as train_config  # noqa: E402
from pipeline.model import kernels, loading  # noqa: E402
from pipeline.errors import UserError  # noqa: E402
from pipeline.model.loss import TokenLoss, collate  # noqa: E402

DEV = torch.device("cuda")  # main() sets the CPU for --smoke
SHAPE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4)
BF16 = True  # autocast in the checks that compare bf16 paths (main() turns it off for --smoke)
results: dict = {}


def record(name: str, ok: bool, **figures) -> None:
    results[name] = {"ok": bool(ok), **figures}
    print(f"{'PASS' if ok else 'FAIL'} {name} {json.dumps(figures, default=str)}", flush=True)


def model(*overrides, liger=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = train_config.to_typed(OmegaConf.from_dotlist(["model.path=check", "tokens.train_cache=t", *overrides]))
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**SHAPE, attn_implementation="sdpa")).to(DEV)
    if liger:
        kernels.apply_liger(base)
    lm = loading.attach_lora(base, cfg).train()
    with torch.no_grad():
        for n, p in lm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return lm


def batch(lengths=(300, 257, 128, 64), seed=1):
    g = torch.Generator().manual_seed(seed)
    records = []
    for n in lengths:
        ids = torch.randint(3, SHAPE["vocab_size"], (n,), generator=g)
        labels = ids.clone()
        labels[: n // 4] = -100
        records.append((ids, labels))
    return collate(records, list(range(len(records))), 0).to(DEV)


def loss_and_grads(loss_model, b, bf16: bool):
    loss_model.zero_grad(set_to_none=True)
    with torch.autocast(DEV.type, torch.bfloat16, enabled=bf16):
        loss = loss_model(b)
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in loss_model.named_parameters() if p.grad is not None}


def compare(name, a, b, bf16: bool) -> None:
    tol, loss_tol = (3e-2, 1e-2) if bf16 else (1e-4, 1e-5)
    loss_rel = float((a[0] - b[0]).abs() / b[0].abs())
    grad_rel = max(float((a[1][k] - b[1][k]).abs().max() / b[1][k].abs().max().clamp_min(1e-12)) for k in b[1])
    record(name, a[1].keys() == b[1].keys() and loss_rel <= loss_tol and grad_rel <= tol, loss_rel=loss_rel,
           grad_rel=grad_rel, dtype="bf16" if bf16 else "fp32")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="on the CPU in fp32: only the checks that need no CUDA")
    args = ap.parse_args()
    import peft
    import transformers

    global DEV, BF16
    if args.smoke:
        DEV, BF16 = torch.device("cpu"), False
    results["smoke"] = args.smoke
    results["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
                           "peft": peft.__version__, "gpu": torch.cuda.get_device_name(0) if DEV.type == "cuda" else None,
                           "liger": importlib.util.find_spec("liger_kernel") is not None,
                           "cce": importlib.util.find_spec("cut_cross_entropy") is not None}
    print(results["versions"], flush=True)
    checks = [check_syncs, check_compile, check_fused_lora, check_fused_losses, check_liger, check_compat]
    for check in checks:
        if DEV.type != "cuda" and check in (check_syncs, check_compile, check_liger):  # Liger is Triton: CUDA only
            results[check.__name__] = {"ok": True, "skipped": "needs CUDA"}
            print(f"SKIP {check.__name__}: needs CUDA", flush=True)
            continue
        try:
            check()
        except Exception as err:  # noqa: BLE001 (each check reports on its own; the others still run)
            record(check.__name__, False, error=f"{type(err).__name__}: {str(err)[:300]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    sys.exit(0 if all(r.get("ok", True) for k, r in results.items() if k not in ("versions", "smoke")) else 1)


def check_syncs() -> None:
    loss_model = TokenLoss(model())
    b = batch()
    loss_and_grads(loss_model, b, BF16)  # warm: kernels chosen, compiled chunk built
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loss_and_grads(loss_model, b, BF16)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # The mode's own notice ("Synchronization debug mode is a prototype feature ...") is not a sync: the first
    # run on an H200 counted it as one.
    syncs = [str(w.message)[:120] for w in seen if "ynchroniz" in str(w.message) and "prototype" not in str(w.message)]
    record("host syncs in a mask-free forward + backward", not syncs, syncs=len(syncs), first=syncs[:2])


def check_compile() -> None:
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    loss_model = TokenLoss(model())
    for seed, lengths in enumerate([(300, 257, 128, 64), (511, 20, 33, 400), (90, 91, 92, 93), (1000, 7, 8, 9)]):
        loss_and_grads(loss_model, batch(lengths, seed), BF16)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    record("compiled chunk loss: one graph across micro-batch shapes", graphs == 1, graphs=graphs)


def check_fused_lora() -> None:
    b = batch()
    compare("lora.fused vs peft's forward", loss_and_grads(TokenLoss(model("lora.fused=true")), b, BF16),
            loss_and_grads(TokenLoss(model()), b, BF16), BF16)


def check_fused_losses() -> None:
    b = batch()
    for kind in ("liger", "cce"):
        if not kernels.installed(kind):
            results[f"fused_loss={kind}"] = {"ok": True, "skipped": "not installed"}
            print(f"SKIP fused_loss={kind}: not installed", flush=True)
            continue
        for bf16 in (False, True) if BF16 else (False,):
            if kind == "cce" and not bf16:  # an fp32 head: refused up front (its backward asserts half weights)
                try:
                    TokenLoss(model(), fused_loss=kind)
                except UserError as err:
                    record("model.fused_loss=cce refuses an fp32 head", "bf16 or fp16" in str(err))
                else:
                    record("model.fused_loss=cce refuses an fp32 head", False, error="accepted")
                continue
            lm = model()
            if bf16:  # frozen base weights in bf16, as precision.mode=bf16 loads them (cce needs it)
                lm.get_output_embeddings().to(torch.bfloat16)
            fused, plain = TokenLoss(lm, fused_loss=kind), TokenLoss(lm)
            compare(f"model.fused_loss={kind} vs chunked", loss_and_grads(fused, b, bf16),
                    loss_and_grads(plain, b, bf16), bf16)


def check_liger() -> None:
    if importlib.util.find_spec("liger_kernel") is None:
        results["liger_kernels"] = {"ok": True, "skipped": "not installed"}
        print("SKIP model.liger_kernels: not installed", flush=True)
        return
    b = batch()
    plain = loss_and_grads(TokenLoss(model()), b, BF16)
    compare("model.liger_kernels vs plain decoder", loss_and_grads(TokenLoss(model(liger=True)), b, BF16), plain, BF16)


def check_compat() -> None:
    lm = model()
    compat.enable_activation_checkpointing(lm.get_base_model(), use_reentrant=False)
    loss_and_grads(TokenLoss(lm), batch(), BF16)
    record("activation checkpointing through compat", True, reusable_dcp_stager=compat.stager_reusable())


if __name__ == "__main__":
    main()
