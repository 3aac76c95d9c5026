"""CPU benchmark (QLoRA): host memory of one update with a bf16 base vs a 4-bit (nf4) base, beside the plan's estimate.

    python bench/bench_quant.py                 # ~350M-parameter model, 3 updates per arm
    python bench/bench_quant.py --smoke         # tiny model, 2 updates: checks it runs

Our trainer, one process as the workflow runs a stage (`python -m pipeline
train`), on a Llama-style model built from a config (hidden 1024, 24 layers,
16 heads / 8 key-value heads, intermediate 2816, vocabulary 32,000, untied
head: 349M parameters, random init, saved in bf16 as a user's base would be).
Both arms train LoRA and EMA at their defaults under bf16 autocast
(`precision.mode=bf16`, `model.dtype=bf16`) on micro-batches of 2 x 128 tokens;
the nf4 arm adds `model.quantization=nf4` (double quantization, compute in the
autocast dtype). Nothing else differs.

Measured in the training process (a probe around the trainer's own calls):

  base weights' share  the RSS rise while `pipeline.model.loading.load_base` loads
                       the base (inside `build`, which then attaches the adapter:
                       reported too), every byte of the model then read once (gc before and after; a bf16 base read in its
                       stored dtype stays mapped from its file, resident only once a
                       forward touches it: the read makes it so), and, exactly, the
                       bytes of the base's tensors (packed 4-bit weights and
                       quantization constants included; LoRA excluded)
  one update           the RSS at the update's start and the highest RSS sampled
                       every millisecond during it (bench/_peak.py); the figure is
                       the largest over the run's updates

Beside each, the plan's estimate (`pipeline.model.memory.estimate`, the function
`plan` prints, on the resolved config of the run): its base weights (the parts
named "weights"), and its total without the 1 GiB it allows a GPU for the CUDA
context (no such thing on a CPU). The estimate is per GPU for a GPU run; on the
CPU it is compared with the host RSS of the same tensors. Goal: nf4 base
weights' share <= 0.45 x bf16's.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

SHAPE = dict(model_type="llama", hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=8,
             intermediate_size=2816, vocab_size=32000, tie_word_embeddings=False)
SMOKE_SHAPE = {**SHAPE, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 256, "vocab_size": 1000}
ARMS = {"bf16": [], "nf4": ["model.quantization=nf4"]}
COMMON = ["model.dtype=bf16", "precision.mode=bf16", "optim.global_batch=2", "optim.micro_batch=2",
          "checkpoint.save_every=0", "checkpoint.async_save=false"]
GOAL = 0.45
LAZY_IMPORTS = ["torch", "transformers", "accelerate", "safetensors.torch", "peft", "peft.tuners.lora.bnb",
                "bitsandbytes", "transformers.integrations.bitsandbytes", "transformers.quantizers.quantizer_bnb_4bit",
                "transformers.models.llama.modeling_llama", "pipeline.train.stage", "pipeline.model.loss"]


# --- the training process (`--child`) --------------------------------------------------------------


def _base_bytes(model) -> int:
    """Bytes of the base's tensors (the LoRA ones left out), each storage once (a tied head is shared)."""
    seen, total = set(), 0
    for key, t in model.state_dict().items():
        if "lora_" in key or not hasattr(t, "untyped_storage") or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        total += t.untyped_storage().nbytes()
    return total


def _touch(model) -> None:
    """Read every byte of the model's tensors once. A float base read from safetensors in its stored
    dtype stays mapped from the file, and its pages become resident only when the first forward reads
    them; reading them here makes the load's RSS rise what the model holds once it runs."""
    import torch

    with torch.no_grad():
        for t in model.state_dict().values():
            if isinstance(t, torch.Tensor) and t.numel():
                t.detach().contiguous().reshape(-1).view(torch.uint8).sum()


def child(result: Path, argv: list[str]) -> int:
    """Train one stage (`python -m pipeline train argv`) with the probes; write their figures to `result`."""
    import importlib

    import _peak

    from pipeline import cli
    from pipeline.model import loading

    # The libraries' own memory is not the model's: every module the load imports lazily is imported
    # before the probe (else the first model load of the process counts ~200 MiB of imports).
    for module in LAZY_IMPORTS:
        importlib.import_module(module)

    figures: dict = {}
    build, load_base = loading.build, loading.load_base

    def probed(function, prefix: str):
        def call(*args, **kwargs):
            gc.collect()
            before = _peak._rss()
            model = function(*args, **kwargs)
            loaded = _peak._rss() - before
            _touch(model)
            gc.collect()
            figures.update({f"{prefix}rss_before": before, f"{prefix}rss_rise": _peak._rss() - before,
                            f"{prefix}rss_rise_untouched": loaded, f"{prefix}bytes": _base_bytes(model)})
            return model
        return call

    # The trainer's own load, as the strategy calls it: `loading.build` (base + adapter), and inside it
    # `loading.load_base` (the base alone: its share).
    loading.build, loading.load_base = probed(build, "model_"), probed(load_base, "base_")
    updates = _peak.probe_updates()
    rc = cli.main(["train", *argv])
    result.write_text(json.dumps({**figures, "updates": updates}))
    return rc


# --- the benchmark -------------------------------------------------------------------------------


def _unquantized(shape: dict) -> int:
    """Parameters outside the quantized linear layers: embeddings and an untied head (norms are negligible)."""
    return shape["vocab_size"] * shape["hidden_size"] * (1 if shape["tie_word_embeddings"] else 2)


def _model(root: Path, shape: dict) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.demo import text as demo

    tok = demo.build_tokenizer()
    spec = dict(shape)
    config = AutoConfig.for_model(spec.pop("model_type"), max_position_embeddings=1024, pad_token_id=tok.pad_token_id,
                                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **spec)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(root)
    tok.save_pretrained(root)
    return root


def _estimate(config: Path, model: Path, seq_len: int) -> dict:
    """The plan's estimate for the run's resolved config: its base weights' parts and its total (which
    counts no CUDA runtime: the plan takes that off the GPU's memory instead, `memory.budget`), bytes."""
    from pipeline import config as train_config
    from pipeline.model import memory

    cfg = train_config.load(config)
    shapes = memory.read_shapes(str(model))
    micro, _ = train_config.batch_split(cfg, 1)
    run = memory.Run(micro_batch=micro, length=seq_len, world=1, sharded=False, checkpointed=0, precision="bf16")
    est = memory.estimate(cfg, shapes, run)
    return {"weights": sum(b for k, b in est.parts.items() if k.startswith("weights")),
            "total_without_runtime": est.total, "parts": est.parts, "params": shapes.params}


def _run(name: str, work: Path, model: Path, cache: Path, *, updates: int, seq_len: int, threads: int) -> dict:
    """Plan and train one arm in a fresh process under the probes; its figures (MiB)."""
    from pipeline.planning import plan as planner

    work.mkdir(parents=True)
    overrides = [f"model.path={model}", f"{C.KEY_TRAIN_CACHE}={cache}", f"{C.KEY_VAL_CACHE}=null",
                 *C.BENCH_OVERRIDES, *COMMON, *ARMS[name]]
    args = ["--total-updates", str(updates), "--pilot-fraction", "0.5", "--num-chunks", "1",
            "--resolved-config", C.resolved_config(overrides), "--export-weights", "raw", "--max-length", str(seq_len),
            "--out-plan", str(work / "plan.json"), "--out-config", str(work / "train_config.yaml")]
    assert planner.main(args) == 0
    plan = json.loads((work / "plan.json").read_text())
    plan["stages"] = [{"name": "all", "start": 0, "end": updates}]
    (work / "plan.json").write_text(json.dumps(plan))
    cmd = [sys.executable, __file__, "--child", str(work / "probe.json"), "--plan", str(work / "plan.json"),
           "--config", str(work / "train_config.yaml"), "--stage", "all", "--scratch", str(work / "scratch"),
           "--out", str(work / "out")]
    C.run_child(cmd, work, threads, f"the {name} arm")
    probe = json.loads((work / "probe.json").read_text())
    est = _estimate(work / "train_config.yaml", model, seq_len)
    mib = 2**20
    return {"base_rss_mb": probe["base_rss_rise"] / mib, "base_bytes_mb": probe["base_bytes"] / mib,
            "model_rss_mb": probe["model_rss_rise"] / mib,
            "update_peak_rss_mb": max(u["rss_peak"] for u in probe["updates"]) / mib,
            "update_rise_mb": max(u["rss_peak"] - u["rss_start"] for u in probe["updates"]) / mib,
            "rss_before_model_mb": probe["model_rss_before"] / mib,
            "base_rss_untouched_mb": probe["base_rss_rise_untouched"] / mib,
            "estimate_weights_mb": est["weights"] / mib, "estimate_total_mb": est["total_without_runtime"] / mib,
            "estimate_parts_mb": {k: v / mib for k, v in est["parts"].items()}, "params": est["params"]}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        sys.exit(child(Path(sys.argv[2]), sys.argv[3:]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=3, help="updates per arm")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per record (2 records per update)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out-dir", type=Path, default=C.RESULTS)
    C.add_smoke(ap)
    args = ap.parse_args()
    machine = C.machine()
    smoke = C.smoke(args, updates=2, seq_len=32, threads=1)
    shape = SMOKE_SHAPE if smoke else SHAPE
    command = C.command_line(__file__)
    started = time.time()

    import bench_gpu

    with tempfile.TemporaryDirectory(prefix="bench_quant_") as tmp:
        tmp = Path(tmp)
        model = _model(tmp / "model", shape)
        bench_gpu.build_cache(tmp / "train.safetensors", records=2 * args.updates, seq_len=args.seq_len,
                              vocab=shape["vocab_size"])
        fig, loads = {}, []
        for name in ARMS:
            loads.append(C.load_average())
            fig[name] = _run(name, tmp / name, model, tmp / "train.safetensors", updates=args.updates,
                             seq_len=args.seq_len, threads=args.threads)
            print(name, fig[name], file=sys.stderr)

    b, q = fig["bf16"], fig["nf4"]
    ratio = q["base_rss_mb"] / b["base_rss_mb"]
    versions = C.versions("torch", "transformers", "peft", "bitsandbytes")
    data = {"name": "quant", "command": command, "date": C.today(), "machine": machine, "versions": versions,
            "trainer_commit": C.git_commit(), "wall_s": time.time() - started,
            "settings": {**vars(args), "out_dir": str(args.out_dir), "model": shape, "overrides": COMMON},
            "figures": {**fig, "base_share_ratio": ratio, "base_bytes_ratio": q["base_bytes_mb"] / b["base_bytes_mb"],
                        "update_peak_ratio": q["update_peak_rss_mb"] / b["update_peak_rss_mb"], "goal": GOAL},
            "load_average_per_run": loads}
    met = "met" if ratio <= GOAL else "NOT met"
    lines = [
        "# Host memory of one update: bf16 base vs nf4 base (QLoRA), measured beside the plan's estimate",
        "",
        f"Command: `{command}` (from the repository root); {C.today()}.",
        "",
        f"Machine: {C.machine_text(machine)}. Versions: {C.versions_text(versions)}; trainer at commit "
        f"{data['trainer_commit']}.",
        "",
        f"Model: Llama-style, {b['params'] / 1e6:.0f}M parameters (hidden {shape['hidden_size']}, "
        f"{shape['num_hidden_layers']} layers, intermediate {shape['intermediate_size']}, vocabulary "
        f"{shape['vocab_size']:,}, untied head), random init, stored bf16; LoRA and EMA defaults, bf16 autocast, "
        f"micro-batch 2 x {args.seq_len} tokens, {args.updates} updates per arm, {args.threads} torch thread(s). "
        "Method: bench/bench_quant.py's docstring.",
        "",
        "| figure | bf16 base | nf4 base | nf4 / bf16 | goal |",
        "|---|---:|---:|---:|---|",
        f"| **base weights' share**: RSS rise of the base's load, `loading.load_base` (measured) | {b['base_rss_mb']:,.0f} MiB | "
        f"{q['base_rss_mb']:,.0f} MiB | **{ratio:.3f}** | <= {GOAL}: {met} |",
        f"| base weights' share: bytes of the base's tensors (measured, exact) | {b['base_bytes_mb']:,.0f} MiB | "
        f"{q['base_bytes_mb']:,.0f} MiB | {data['figures']['base_bytes_ratio']:.2f} | |",
        f"| base weights' share: the plan's estimate | {b['estimate_weights_mb']:,.0f} MiB | "
        f"{q['estimate_weights_mb']:,.0f} MiB | {q['estimate_weights_mb'] / b['estimate_weights_mb']:.2f} | |",
        f"| peak RSS of one update, whole process (measured; highest of the run's updates) | "
        f"{b['update_peak_rss_mb']:,.0f} MiB | {q['update_peak_rss_mb']:,.0f} MiB | "
        f"{data['figures']['update_peak_ratio']:.2f} | |",
        f"| the plan's estimate of one update (its total less the 1 GiB CUDA allowance) | "
        f"{b['estimate_total_mb']:,.0f} MiB | {q['estimate_total_mb']:,.0f} MiB | "
        f"{q['estimate_total_mb'] / b['estimate_total_mb']:.2f} | |",
        f"| RSS rise during one update (measured; largest) | {b['update_rise_mb']:,.0f} MiB | "
        f"{q['update_rise_mb']:,.0f} MiB | | |",
        f"| RSS rise of the whole model's load, `loading.build`: the base + the LoRA adapter (measured) | "
        f"{b['model_rss_mb']:,.0f} MiB | {q['model_rss_mb']:,.0f} MiB | {q['model_rss_mb'] / b['model_rss_mb']:.2f} | |",
        f"| RSS rise of the base's load before its bytes are read (a bf16 base stays mapped from its file) | "
        f"{b['base_rss_untouched_mb']:,.0f} MiB | {q['base_rss_untouched_mb']:,.0f} MiB | | |",
        f"| RSS of the process before the model loads (libraries, data) | {b['rss_before_model_mb']:,.0f} MiB | "
        f"{q['rss_before_model_mb']:,.0f} MiB | | |",
        "",
        "The plan's estimate, part by part (MiB):",
        "",
        "| part | bf16 base | nf4 base |",
        "|---|---:|---:|",
        *[f"| {k} | {b['estimate_parts_mb'].get(k, 0):,.1f} | {q['estimate_parts_mb'].get(k, 0):,.1f} |"
          for k in dict.fromkeys([*b["estimate_parts_mb"], *q["estimate_parts_mb"]])],
        "",
        "The whole-process peak holds what the estimate does not count on a CPU: the libraries (torch, "
        "transformers, bitsandbytes: the RSS before the model loads) and the data. The 4-bit share keeps the "
        f"embeddings and the output head in bf16 ({_unquantized(shape) / 1e6:.1f}M of the "
        f"{b['params'] / 1e6:.0f}M parameters here), which is why it is above the "
        f"{(0.5 + 1 / 64 + 4 / (64 * 256)) / 2:.3f}x of the quantized layers alone (4.13 bits per weight).",
    ]
    C.write_results("quant", lines, data, args.out_dir)


if __name__ == "__main__":
    main()
