"""GPU benchmark: tokens/s, peak memory and MFU of our trainer, LoRA bf16 on a Llama-3.2-1B-shaped model.

    python bench/bench_gpu.py                          # on a machine with a CUDA GPU (defaults: the 1B preset,
                                                       # length 2048, a length mix, micro-batch 8)
    python bench/bench_gpu.py --override model.attn_implementation=flash_attention_2 --override tokens.packing=on
    python bench/bench_gpu.py --preset llama-3-8b --seq-len 2048 4096 --micro-batch 2   # Llama-3-8B shapes
    python bench/bench_gpu.py --arms padded packed     # the padded and the packed paths side by side
    python bench/bench_gpu.py --smoke                  # tiny model, on the GPU if there is one, else on the CPU

Without a CUDA GPU it prints "not measured: no GPU", records that in
bench/results/gpu.json (unless a real measurement is already there) and exits 0.
`--smoke` runs the whole path (model and cache built, our trainer launched,
FLOPs, the plan's memory estimate, the report; both arms, padded and packed)
on a tiny Llama: in bf16 on a GPU, in fp32 on a CPU, where there is no peak
FLOP/s to give an MFU ("n/a").

Each `--seq-len` and each arm is one trainer run, one row of the report:
`config` trains as the trainer config says, `padded` with tokens.packing=off
(each micro-batch padded to its longest record), `packed` with
tokens.packing=on (records concatenated into rows, kept apart by their
position ids: flash-attention's varlen path, or a block-diagonal mask under
SDPA/eager).

What runs is our trainer itself, as the workflow launches a stage:
`torchrun --standalone --nproc-per-node 1 -m pipeline train` on a plan of one
stage, with the default trainer config (config/train: LoRA r=16, alpha=32 on
all seven Llama projections, EMA with 2 rates, AdamW (fused on CUDA), grad
clip, length-grouped micro-batches, activation checkpointing auto) plus
precision.mode=bf16 (bf16 autocast, frozen base weights in bf16, LoRA and EMA
in fp32). tokens/s is read from the stage's own metrics.jsonl (tokens per
update, padding not counted / update time), median over the updates after
`--warmup`; peak memory is torch.cuda.max_memory_allocated (what tensors
held) beside max_memory_reserved (what the allocator took from the GPU: the
difference is its fragmentation), and the plan's estimate for the same run
(`pipeline.model.memory`).

The model is random-init (throughput does not depend on the weights), built
from a config and saved as a Hugging Face dir. Preset `llama-3.2-1b`:
Llama-3.2-1B's shapes (hidden 2048, 16 layers, 32 query / 8 key-value heads,
MLP 8192, 128,256-token vocabulary, tied embeddings); `llama-3-8b`:
Llama-3-8B's (hidden 4096, 32 layers, 32 / 8 heads, MLP 14336, untied
128,256-token embeddings: about 16 GB of bf16 weights, written to a temp dir
first). The data is a token
cache of random token ids with a length mix (`--lengths mix`): each record's
length uniform in [max/16, max] (mean about half the maximum), its first
10-50% unsupervised (a prompt), as `pipeline tokenize` writes it. The demo
char tokenizer is saved with the model: the trainer only reads its pad id.

Two FLOP counts per token, side by side (each record of length T, S of its
positions supervised; L layers, d hidden, V vocabulary):

    LoRA actual     (4 N_layers + 6 N_lora) T + 4 V d S + 6 L d T^2   per record (the headline)
    6N convention   6 (N_layers + N_head + N_lora) T + 6 L d T^2

N_layers = the decoder layers' matmul weights (of a mixture of experts the active ones: top_k of
the E experts' fused weights, which a token runs through), N_head = V d (counted whether
or not it is tied to the embeddings: the matmul runs), N_lora = the LoRA A/B
matrices. "LoRA actual" is the useful work this trainer does, and the count
LoRA throughput is quoted in (NeMo AutoModel's 402 TFLOP/s for Llama-3-8B LoRA
on one H100 is about 4N per token): the frozen weights get no weight gradients
(4N, not 6N), and the LM head runs at supervised positions only (forward +
gradient to the hidden state). 6N is the pretraining convention (forward 2N +
backward 4N: PaLM appendix B, nanoGPT's estimate_mfu, torchtitan), shown
beside it. Attention: the score and value matmuls, 4 d T^2 a layer forward
over the whole square, causal so half of it is computed (flash/SDPA skip the
masked blocks), times 3 for forward and backward: 6 L d T^2. S counts the
positions whose next token is a label: a record of T tokens with a P-token
prompt has T - max(P, 1) (its first token is never a target). Recomputation (activation
checkpointing, the loss's chunk recompute) is not useful work and is in
neither count. MFU = FLOP/s / peak dense bf16 FLOP/s: H100 SXM / H200 989
TFLOP/s, H100 PCIe 756, A100 312 (override with --peak-tflops).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

PRESETS = {
    # Llama-3.2-1B's shapes: GQA 32/8 heads of 64, 128,256 vocab, tied embeddings.
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
                         tie_word_embeddings=True, rope_theta=500000.0),
    # Llama-3-8B's shapes: GQA 32/8 heads of 128, MLP 14336, 128,256 vocab, untied embeddings.
    "llama-3-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
                       tie_word_embeddings=False, rope_theta=500000.0),
    # Llama-style, ~0.4B: TinyLlama-like width/depth with full multi-head attention.
    "llama-0.4b": dict(model_type="llama", hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                       num_key_value_heads=16, intermediate_size=2816, vocab_size=32000, tie_word_embeddings=False),
    # Qwen2-0.5B's shapes (GQA 14/2 heads, 151,936 vocab, tied embeddings).
    "qwen2-0.5b": dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    # For --smoke only.
    "tiny": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, vocab_size=512, tie_word_embeddings=True),
}
PEAK_TFLOPS = [("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("GH200", 989.4), ("A100", 312.0),
               ("L40S", 362.0), ("A10G", 125.0)]
NOT_MEASURED = "not measured: no GPU"
MFU_GOAL = 0.45  # issue 13: >= 45% by the 6N convention, Llama-3.2-1B LoRA bf16 at length 2048 on an H100
ARMS = {"config": [], "padded": ["tokens.packing=off"], "packed": ["tokens.packing=on"]}


class ArmFailed(RuntimeError):
    """One arm's trainer failed: reported as that arm's row; the other arms still run."""


def extra_arm(text: str) -> tuple[str, list[str]]:
    """`--extra-arm NAME=OVERRIDE[,OVERRIDE...]`: a named arm of the trainer config plus those overrides."""
    name, sep, overrides = text.partition("=")
    if not sep or not name or name in ARMS or not overrides:
        raise argparse.ArgumentTypeError(f"--extra-arm {text!r}: expected NAME=key=value[,key=value] with a new NAME")
    return name, overrides.split(",")


def peak_tflops(name: str) -> float | None:
    for key, value in PEAK_TFLOPS:
        if key.lower() in name.lower():
            return value
    return None


def build_model_dir(path: Path, preset: str, seq_len: int) -> dict:
    """The model dir of `_build_model_dir`, built in a child process (on the GPU when there is one), so
    that this process never holds a CUDA context: the trainer it launches plans for the whole GPU."""
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import bench_gpu; "
            f"print(json.dumps(bench_gpu._build_model_dir(bench_gpu.Path({str(path)!r}), "
            f"bench_gpu.PRESETS[{preset!r}], {seq_len})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=C.child_env(),
                          timeout=3600)
    if proc.returncode != 0:
        sys.exit(f"building the {preset} model failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def trainer_env() -> dict:
    """The trainer child's environment: what the workflow's launcher gives a training job (PyTorch's
    CUDA allocator with expandable segments, `pipeline.launch.__main__.allocator_env`), which the
    plan's fragmentation margin assumes."""
    from pipeline.launch.__main__ import allocator_env

    env = C.child_env()
    return {**env, **allocator_env(env)}


def _build_model_dir(path: Path, preset: dict, seq_len: int) -> dict:
    """Random-init model saved in bf16 with the demo tokenizer; returns the shape figures for the FLOPs count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.demo import text as demo

    tok = demo.build_tokenizer()
    spec = dict(preset)
    config = AutoConfig.for_model(spec.pop("model_type"), max_position_embeddings=max(seq_len, 2048),
                                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, **spec)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    in_layers = sum(m.weight.numel() for n, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear) and ".layers." in n)
    # A mixture of experts: a token runs through top_k of the E experts' fused weights (the active parameters).
    from pipeline.model.targets import fused_expert_weights

    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:
        in_layers += sum(p.numel() for _, p in fused_expert_weights(model)) * config.num_experts_per_tok // experts
    info = {"params_total": sum(p.numel() for p in model.parameters()), "params_layers_matmul": in_layers,
            "layers": config.num_hidden_layers, "hidden": config.hidden_size, "vocab": config.vocab_size}
    return info


def record_lengths(records: int, seq_len: int, mix: bool) -> "list[tuple[int, int]]":
    """(length, prompt tokens) per record: uniform in [seq_len/16, seq_len] with a 10-50% prompt, or all full."""
    import numpy as np

    rng = np.random.default_rng(0)
    if not mix:
        return [(seq_len, seq_len // 4)] * records
    lengths = rng.integers(max(2, seq_len // 16), seq_len + 1, size=records)
    return [(int(n), int(n * f)) for n, f in zip(lengths, rng.uniform(0.1, 0.5, size=records))]


def build_cache(path: Path, *, records: int, seq_len: int, vocab: int, mix: bool = False) -> list[tuple[int, int]]:
    """A token cache of random ids (`record_lengths`); returns the (length, prompt) of each record."""
    import numpy as np

    from pipeline.data.cache import IGNORE_INDEX, write_cache

    rng = np.random.default_rng(0)
    shape = record_lengths(records, seq_len, mix)
    ids = rng.integers(10, vocab, size=sum(n for n, _ in shape), dtype=np.int32)
    labels = ids.copy()
    offsets = np.cumsum([0] + [n for n, _ in shape]).astype(np.int64)
    for (n, prompt), start in zip(shape, offsets):
        labels[start:start + prompt] = IGNORE_INDEX
    write_cache(path, input_ids=ids, labels=labels, offsets=offsets, metadata={"split": "train"})
    return shape


def flops_per_token(info: dict, n_lora: int, shape: list[tuple[int, int]]) -> dict:
    """Mean FLOPs per (non-padding) token by both counts of the module docstring, over the records."""
    layers, d, v = info["layers"], info["hidden"], info["vocab"]
    n_layers, n_head = info["params_layers_matmul"], v * d
    tokens = sum(n for n, _ in shape)
    supervised = sum(n - max(p, 1) for n, p in shape)  # the targets: labels at positions 1..T-1
    attention = sum(6 * layers * d * n * n for n, _ in shape)  # causal: half of 12 L d T^2
    six_n = 6 * (n_layers + n_head + n_lora) * tokens + attention
    actual = (4 * n_layers + 6 * n_lora) * tokens + 4 * v * d * supervised + attention
    return {"6n": six_n / tokens, "lora_actual": actual / tokens, "mean_length": tokens / len(shape),
            "supervised_fraction": supervised / tokens}


def lora_params(info: dict, preset: dict, r: int) -> int:
    """A and B matrices of rank r on the seven Llama projections, every layer."""
    d, i = preset["hidden_size"], preset["intermediate_size"]
    head_dim = preset.get("head_dim") or d // preset["num_attention_heads"]
    q, kv = preset["num_attention_heads"] * head_dim, preset["num_key_value_heads"] * head_dim
    shapes = [(d, q), (d, kv), (d, kv), (q, d), (d, i), (d, i), (i, d)]
    return info["layers"] * sum(r * (a + b) for a, b in shapes)


def _not_measured(out_dir: Path, command: str, machine: dict) -> None:
    print(NOT_MEASURED)
    existing = out_dir / "gpu.json"
    if existing.is_file() and json.loads(existing.read_text()).get("status") != NOT_MEASURED:
        print(f"(kept the measurement in {existing})")
        return
    data = {"name": "gpu", "status": NOT_MEASURED, "command": command, "date": C.today(), "machine": machine,
            "trainer_commit": C.git_commit(),
            "versions": C.versions("torch", "transformers", "peft")}
    C.write_results("gpu", ["# GPU throughput, memory and MFU (LoRA, bf16, Llama-3.2-1B-shaped model)", "",
                            f"{NOT_MEASURED} (last tried {C.today()} on: {C.machine_text(machine)}).", "",
                            f"Command: `{command}` on a machine with a CUDA GPU."], data, out_dir)


def train_arm(tmp: Path, args, *, seq_len: int, arm: str, precision: str, info: dict) -> dict:
    """One trainer run (`arm` at `seq_len`) on a fresh cache; returns its metrics rows, the data's shape
    and what the plan and the stage decided."""
    from pipeline import config as train_config
    from pipeline.model import memory

    records = args.steps * args.global_batch
    shape = build_cache(tmp / "train.safetensors", records=records, seq_len=seq_len, vocab=info["vocab"],
                        mix=args.lengths == "mix")
    default = {"model": tmp.parent / "model", "train": tmp / "train.safetensors", "val": "null"}  # no val set
    overrides = [f"optim.global_batch={args.global_batch}", f"optim.micro_batch={args.micro_batch}",
                 "checkpoint.save_every=0", f"precision.mode={precision}", *args.arm_overrides[arm], *args.override]
    run = C.plan_run(tmp / "run", default, total=args.steps, overrides=overrides, single_stage=True)
    cfg = train_config.load(run["config"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           "-m", "pipeline", "train", "--plan", str(run["plan"]), "--config", str(run["config"]),
           "--stage", "all", "--scratch", str(tmp / "scratch"), "--out", str(tmp / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=trainer_env(), timeout=3600)
    if proc.returncode != 0:
        raise ArmFailed(f"training failed ({arm}, length {seq_len}: {proc.returncode}):\n{proc.stderr[-4000:]}")
    # The stage's own line: "k of n layers" where it estimated memory, "off" where it had no budget (a CPU).
    chosen = re.search(r"activation checkpointing (\d+) of \d+ layers|activation checkpointing off", proc.stdout)
    rows = [json.loads(x) for x in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]
    # With profile.updates > 0 (an --extra-arm), the stage's one-line summary of where the time went.
    profiled = re.search(r"\[\S+\] profile of updates .*", proc.stdout + proc.stderr)
    shapes = memory.read_shapes(str(tmp.parent / "model"))
    attention = memory.resolved_attention(cfg.model) or "sdpa"  # as the trainer child resolves it on the GPU
    estimate = memory.estimate(cfg, shapes, memory.Run(
        micro_batch=train_config.batch_split(cfg, 1)[0], length=max(n for n, _ in shape), world=1, sharded=False,
        checkpointed=int(chosen.group(1) or 0) if chosen else 0, precision=precision,
        # Packed micro-batches (pipeline.planning.packing) hold no more tokens, and no wider mask, than padded ones.
        attention=attention))
    return {"cfg": cfg, "shape": shape, "rows": [r for r in rows if "loss" in r][args.warmup:],
            "checkpointing": chosen.group(0) if chosen else "activation checkpointing unknown",
            "estimate_mb": estimate.total / 2**20, "profile": profiled.group(0) if profiled else None}


def arm_figures(arm: str, seq_len: int, trained: dict, per_token: dict, peak: float | None, gpu_name: str) -> dict:
    rows = trained["rows"]
    tps = C.median(r["tokens_per_s"] for r in rows)
    mfu = {k: tps * per_token[k] / (peak * 1e12) if peak else None for k in ("6n", "lora_actual")}
    reserved = [r["mem_reserved_mb"] for r in rows if "mem_reserved_mb" in r]
    return {"arm": arm, "seq_len": seq_len, "tokens_per_s": tps, "mfu_lora_actual": mfu["lora_actual"],
            "mfu_6n": mfu["6n"], "peak_tflops": peak, "gpu": gpu_name, "step_s": C.median(r["step_time_s"] for r in rows),
            "mem_mb": max(r["mem_mb"] for r in rows), "mem_reserved_mb": max(reserved) if reserved else None,
            "estimate_mb": trained["estimate_mb"], "activation_checkpointing": trained["checkpointing"],
            "flops_per_token_6n": per_token["6n"], "flops_per_token_lora_actual": per_token["lora_actual"],
            "mean_length": per_token["mean_length"], "supervised_fraction": per_token["supervised_fraction"],
            "final_loss": rows[-1]["loss"], "profile": trained["profile"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=[p for p in PRESETS if p != "tiny"], default="llama-3.2-1b")
    ap.add_argument("--seq-len", type=int, nargs="+", default=[2048],
                    help="the longest record (data.max_length); several: one run each")
    ap.add_argument("--arms", nargs="*", choices=list(ARMS), default=["config"],
                    help="config: as the trainer config says; padded: tokens.packing=off; packed: tokens.packing=on; "
                         "none (--arms alone): only the --extra-arm arms")
    ap.add_argument("--extra-arm", type=extra_arm, action="append", default=[], metavar="NAME=OVERRIDES",
                    help="one more arm: the config plus comma-separated overrides (e.g. liger=model.fused_loss=liger)")
    ap.add_argument("--lengths", choices=("mix", "fixed"), default="mix",
                    help="mix: uniform in [max/16, max]; fixed: every record --seq-len long")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak dense bf16 TFLOP/s of the GPU")
    ap.add_argument("--override", action="append", default=[], help="extra trainer override (Hydra), repeatable")
    ap.add_argument("--out-dir", type=Path, default=C.RESULTS)
    C.add_smoke(ap)
    args = ap.parse_args()
    if not args.arms and not args.extra_arm:
        ap.error("no arm to run: --arms without a name needs at least one --extra-arm")
    args.arm_overrides = {**ARMS, **dict(args.extra_arm)}
    machine = C.machine()  # before we load the cores ourselves (imports torch: after --help)
    command = C.command_line(__file__)

    # This process never touches CUDA (its context would take GPU memory the trainer plans to have):
    # the GPUs are asked for, and the model is built, in child processes.
    gpus = C.gpus_found()
    cuda = bool(gpus)
    if not C.smoke(args, preset="tiny", seq_len=[64], arms=["padded", "packed"], micro_batch=2, global_batch=4,
                   steps=3, warmup=1) and not cuda:
        return _not_measured(args.out_dir, command, machine)
    preset = PRESETS[args.preset]
    precision = "bf16" if cuda else "fp32"  # a CPU gets here only in a smoke run
    gpu_name = gpus[0][0] if cuda else "cpu"
    peak = args.peak_tflops or peak_tflops(gpu_name)
    if peak is None and not args.smoke:
        sys.exit(f"unknown peak FLOP/s for {gpu_name!r}: pass --peak-tflops")

    started = time.time()
    arms, failed = [], []
    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as tmp:
        tmp = Path(tmp)
        info = build_model_dir(tmp / "model", args.preset, max(args.seq_len))
        for seq_len in args.seq_len:
            for arm in [*args.arms, *(name for name, _ in args.extra_arm)]:
                try:
                    trained = train_arm(tmp / f"{arm}-{seq_len}", args, seq_len=seq_len, arm=arm,
                                        precision=precision, info=info)
                except Exception as e:  # ArmFailed (an OOM), or a setting refused at plan: only this arm's row is lost
                    print(e, file=sys.stderr, flush=True)
                    failed.append({"arm": arm, "seq_len": seq_len, "error": str(e)[-600:]})
                    continue
                cfg = trained["cfg"]
                n_lora = lora_params(info, preset, cfg.lora.r)
                per_token = flops_per_token(info, n_lora, trained["shape"])
                arms.append(arm_figures(arm, seq_len, trained, per_token, peak, gpu_name))
                print("arm done:", json.dumps(arms[-1]), flush=True)  # kept in the log if a later arm hangs
    if not arms:
        sys.exit(f"every arm failed: {json.dumps(failed, indent=1)}")
    figures = arms[0]  # what bench/run_all.py quotes
    print(json.dumps({"arms": arms, **info, "lora_params": n_lora}, indent=1))
    versions = C.versions("torch", "transformers", "peft", "flash_attn")
    data = {"name": "gpu", "status": "measured", "command": command, "date": C.today(), "machine": machine,
            "versions": versions, "trainer_commit": C.git_commit(), "wall_s": time.time() - started,
            "settings": {**vars(args), "out_dir": str(args.out_dir), "model": {**preset, **info},
                         "lora": {"r": cfg.lora.r, "alpha": cfg.lora.alpha, "params": n_lora},
                         "ema_rates": list(cfg.ema.rates)},
            "figures": figures, "arms": arms, "failed_arms": failed}
    C.write_results("gpu", report(args, command, versions, data, arms, precision, info, n_lora, cfg, peak),
                    data, args.out_dir)


def report(args, command, versions, data, arms, precision, info, n_lora, cfg, peak) -> list[str]:
    pct = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    gib = lambda mb: "n/a" if mb is None else f"{mb / 1024:.1f}"  # noqa: E731
    goal = lambda f: "n/a" if f["mfu_6n"] is None else "met" if f["mfu_6n"] >= MFU_GOAL else "NOT met"  # noqa: E731
    first = arms[0]
    lines = [
        "# GPU throughput, memory and MFU (LoRA, bf16)",
        "",
        f"Command: `{command}` (from the repository root); {C.today()}.",
        "",
        f"Machine: {C.machine_text(data['machine'])}. Versions: {C.versions_text(versions)}; "
        f"trainer at commit {data['trainer_commit']}.",
        "",
        f"Model: {args.preset}, random init, {info['params_total'] / 1e6:.0f}M parameters, {precision} weights + "
        f"{precision} autocast; LoRA r={cfg.lora.r} alpha={cfg.lora.alpha} on {', '.join(cfg.lora.target_modules)} "
        f"({n_lora / 1e6:.1f}M parameters, fp32), EMA {list(cfg.ema.rates)}, attention {cfg.model.attn_implementation}. "
        f"Batch {args.global_batch} records per update (micro-batch at most {args.micro_batch}), lengths "
        f"{args.lengths} (mean {first['mean_length']:.0f} at the first length, "
        f"{100 * first['supervised_fraction']:.0f}% of tokens supervised); {args.steps} updates, the first "
        f"{args.warmup} excluded. Peak {'unknown' if peak is None else f'{peak:.0f}'} TFLOP/s. FLOP counts: see "
        "bench/bench_gpu.py's docstring (MFU LoRA actual is the headline; 6N beside it, the goal's convention).",
        "",
        "| arm | length | tokens/s (median, padding not counted) | MFU LoRA actual | MFU 6N "
        f"(goal >= {100 * MFU_GOAL:.0f}% on H100) | step time | peak allocated / reserved / plan's estimate (GiB) "
        "| activation checkpointing |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for f in arms:
        lines.append(f"| {f['arm']} | {f['seq_len']} | {f['tokens_per_s']:,.0f} | {pct(f['mfu_lora_actual'])} "
                     f"({f['flops_per_token_lora_actual'] / 1e9:.3g} GFLOP/token) | {pct(f['mfu_6n'])} "
                     f"({f['flops_per_token_6n'] / 1e9:.3g} GFLOP/token): {goal(f)} | {f['step_s']:.3f} s | "
                     f"{gib(f['mem_mb'])} / {gib(f['mem_reserved_mb'])} / {gib(f['estimate_mb'])} | "
                     f"{f['activation_checkpointing'].removeprefix('activation checkpointing ')} |")
    lines += ["", *(f"Profile ({f['arm']}, {f['seq_len']}): {f['profile']}" for f in arms if f["profile"])]
    for f in data["failed_arms"]:
        lines.append(f"| {f['arm']} | {f['seq_len']} | failed: {f['error'].splitlines()[-1][:200]} | | | | | |")
    if args.extra_arm:
        lines += ["", "Extra arms: " + "; ".join(f"{n}: {', '.join(o)}" for n, o in args.extra_arm) + "."]
    return lines


if __name__ == "__main__":
    main()
