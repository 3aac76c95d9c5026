"""How much GPU memory a training run needs, from the model's config.json alone.

`plan` uses it to refuse, before any GPU work, a run that cannot fit its GPUs
(naming the knobs that would make it fit); a stage uses it to decide
`model.activation_checkpointing=auto`: the fewest decoder layers (the first k)
to checkpoint so that the estimate fits the budget. Plan and stage decide
through one function (`decide`), from the same derived micro-batch
(`pipeline.config.batch_split`), so they cannot disagree. Nothing is loaded or allocated: the
estimate works from the shapes in config.json (`Shapes`), so an 8B model can
be checked on a laptop.

Per GPU, in bytes:

  weights         every base parameter in the weights dtype (LoRA: `model.dtype`,
                  auto = the autocast dtype; full fine-tuning: fp32). A quantized
                  base (`model.quantization`, bitsandbytes) stores its decoder
                  layers' linear weights in
                    nf4 / fp4   0.5 byte per weight + one fp32 absmax per block of
                                64 (0.0625 B/weight), or with `model.quant_double`
                                one 8-bit absmax per block + one fp32 per 256 blocks
                                (0.0158 B/weight)
                    int8        1 byte per weight + one fp32 scale per output row
                  and the rest (embeddings, norms, head) in the weights dtype;
                  a forward or backward dequantizes one layer's weight at a time
                  (the largest: one projection in the compute dtype)
  LoRA weights    r x (in + out) per targeted projection (x E for a layer's fused experts), fp32
  gradients       one fp32 value per trained parameter
  optimizer       AdamW: two fp32 moments per trained parameter
  EMA shadows     one fp32 copy of the trained parameters per rate
  activations     what autograd keeps for the backward, per token of the
                  largest micro-batch (micro-batch x the longest sequence):
                  per decoder layer, without checkpointing,
                    norms       2 x (4H + aH)   fp32 copy of the input + output
                    attention   a(3q + 2kv) + 4 heads   q,k,v after RoPE, output,
                                o_proj input, logsumexp (SDPA/flash; eager adds
                                (4 + a) x heads x T for its probabilities)
                    MLP         4aI             gate, up, act(gate), product (mixture of
                                                experts: 4a(kI_e + I_s), the k experts a token
                                                runs through and a shared expert)
                    LoRA        (a + 1) x in    per target when lora.dropout > 0
                                                (the dropped input and its mask)
                  (a = bytes of the compute dtype, H hidden, I intermediate,
                  q / kv the query / key-value widths). With the first k of
                  the L layers checkpointed, each of those keeps only its input
                  (k x rH, r = residual-stream bytes); the peak is the larger
                  of the other L - k layers' activations (at the start of the
                  backward) and one checkpointed layer recomputed (twice its
                  activations: the recompute and its gradients), which happens
                  only after the backward has freed the later layers'.
  loss            one chunk of logits (`pipeline.model.loss`): rows x vocab x
                  (2a + 12) bytes
  MoE, LoRA on    peft's ParamWrapper computes each MoE layer's expert weights
  fused experts   plus their LoRA delta (all E experts, compute dtype) in the
                  forward, and autograd keeps that copy until the layer's
                  backward: one per layer not checkpointed (one in flight for
                  the checkpointed ones)
  attention mask  SDPA / eager: a micro-batch's rows (at most micro_batch, each
                  at most `length` wide) get a (width x width) mask, the
                  packed rows' block-causal one (or a padded batch's padding),
                  boolean, which the kernel takes as a bias in the compute
                  dtype: (1 + a) bytes per element. Counted whether or not the
                  layout needs it (flat rows, flash-attention and flex's block
                  mask need none; nor do padded batches of the mask-free
                  families, `pipeline.model.loss`): the estimate is a bound
  FSDP            weights, gradients, optimizer, EMA divided by the GPUs, plus
                  the unsharded root (embeddings, head) and two layers in flight
The budget it must fit (`budget`) is each GPU's memory less what PyTorch's
allocator never gets: the CUDA context (`CUDA_CONTEXT_BYTES`), NCCL's buffers
when there is more than one process (`NCCL_BYTES`), and a fragmentation margin
(`FRAGMENTATION`, a fraction of the GPU; launched training jobs set
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, which keeps fragmentation
small: `pipeline.launch.__main__.allocator_env`).

Parameter counts (`pipeline.model.shapes`): the Llama-shaped formula of `Shapes` from config.json, or,
where the architecture can be built on the meta device (`model_shapes`: nothing
read, nothing allocated), the model's own counts (`Counts`): every parameter,
the experts' (all E of them: the memory estimate holds every expert), the
parameters a token runs through (the active ones: top-k of E experts, for
throughput and MFU), and the LoRA parameters of the resolved targets
(`pipeline.model.targets`). Activations keep the formula (hybrids' Mamba and
linear-attention layers are counted as attention layers).

It is an estimate of the steady state, not a measurement: it ignores the
evaluation forward (smaller than a training step). Checked against a measured
peak: `bench/bench_gpu.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.config import ALL_LINEAR, LoraConfig, ModelConfig, Quantization, TrainConfig, batch_split
from pipeline.errors import UserError
from pipeline.model.loss import chunk_tokens
from pipeline.model.shapes import Shapes, model_shapes, read_shapes  # noqa: F401  (memory.model_shapes, ...)

GiB = 2**30
MiB = 2**20
# The CUDA context, loaded kernel images and the cuBLAS/cuDNN handles and workspaces: memory the GPU
# holds for the process outside PyTorch's caching allocator (nvidia-smi's "used" minus
# torch.cuda.memory_reserved()). About 0.5 GiB on an H100 with lazy module loading (the CUDA 12
# default) before cuDNN and the attention kernels load; cuBLAS adds 32 MiB of workspace per stream on
# Hopper (CUBLAS_WORKSPACE_CONFIG's default there). Rounded up, as the old flat allowance was.
CUDA_CONTEXT_BYTES = 1 * GiB
# NCCL's communicator memory when world > 1: per peer and channel a send and a receive buffer of
# NCCL_BUFFSIZE (4 MiB by default, NCCL's environment-variable docs), up to 32 channels over NVLink,
# plus NVLS (NVLink SHARP) buffers on H100 systems: a few hundred MiB to about 1 GiB per GPU in
# practice. NCCL allocates it with cudaMalloc, outside PyTorch's allocator.
NCCL_BYTES = 1 * GiB
# Memory the caching allocator reserves but cannot hand out (partly used blocks). With
# expandable_segments (set for every launched job) it is small; 5% of the GPU is a margin, not a
# measurement (compare max_memory_reserved with max_memory_allocated in the metrics to check it).
FRAGMENTATION = 0.05
EVERY_LAYER = 2**31  # `Run.checkpointed` of `on` when the layer count is unknown: at least every layer
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Run:
    """What of the run the estimate depends on besides the model's shapes."""

    micro_batch: int
    length: int  # tokens of the longest sequence
    world: int  # GPUs (processes)
    sharded: bool  # FSDP
    checkpointed: int  # decoder layers with activation checkpointing (the first ones)
    precision: str  # fp32 | bf16 | fp16 (the compute dtype)
    attention: str | None = None  # the resolved model.attn_implementation (None: the setting; auto = sdpa)

    def attention_kernel(self, model: ModelConfig) -> str:
        if self.attention is not None:
            return self.attention
        return "sdpa" if model.attn_implementation == "auto" else str(model.attn_implementation)

    def describe(self, layers: int) -> str:
        return (f"{self.precision}, {self.world} GPU{'s' if self.world > 1 else ''}"
                f"{' FSDP' if self.sharded else ''}, micro-batch {self.micro_batch} x {self.length} tokens, "
                f"{checkpointing_text(self.checkpointed, layers)}")


def checkpointing_text(checkpointed: int, layers: int) -> str:
    """How the plan and the stage log show the choice: 'activation checkpointing k of n layers'."""
    return f"activation checkpointing {min(checkpointed, layers)} of {layers} layers"


@dataclass(frozen=True)
class Estimate:
    run: Run
    layers: int  # decoder layers of the model
    parts: dict[str, int]  # what -> bytes per GPU

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def table(self) -> str:
        width = max(34, *map(len, self.parts))
        rows = [f"  {name:<{width}} {_size(b)}" for name, b in [*self.parts.items(), ("total", self.total)]]
        return "\n".join([f"memory per GPU ({self.run.describe(self.layers)}):", *rows])


def _size(b: int) -> str:
    return f"{b / GiB:9.2f} GiB" if b >= GiB // 100 else f"{b / 2**20:9.2f} MiB"


def estimate(cfg: TrainConfig, shapes: Shapes, run: Run) -> Estimate:
    """Bytes per GPU of training `shapes` under `cfg` and `run` (see the module docstring)."""
    a = _DTYPE_BYTES[run.precision]
    lora = cfg.lora.enabled
    weight_name = _weights_dtype(cfg, run.precision)
    w = _DTYPE_BYTES[weight_name]
    trained = _lora_params(cfg, shapes) if lora else shapes.params
    shard = run.world if run.sharded else 1
    parts = _weights(cfg.model, shapes, weight_name, run.precision, shard)
    if lora:
        parts["LoRA weights (fp32)"] = trained * 4 // shard
    parts["gradients (fp32)"] = trained * 4 // shard
    parts["optimizer (AdamW, fp32)"] = trained * 8 // shard
    if cfg.ema.rates:
        parts[f"EMA shadows ({len(cfg.ema.rates)} rates, fp32)"] = trained * 4 * len(cfg.ema.rates) // shard
    if run.sharded:
        parts["FSDP unsharded root + 2 layers"] = (shapes.root_params + 2 * shapes.layer_params) * w
    tokens = run.micro_batch * run.length
    parts["activations"] = tokens * _activation_bytes_per_token(cfg, shapes, run, a, residual=w)
    if lora and shapes.counts is not None and shapes.counts.fused_adapted:
        layers = shapes.counts.moe_layers
        k = min(run.checkpointed, layers)
        kept = layers - k + (1 if k else 0)
        parts["expert weights + LoRA delta (ParamWrapper)"] = kept * shapes.counts.expert_layer * a // shard
    parts["loss (one chunk of logits)"] = min(tokens, chunk_tokens(shapes.vocab)) * shapes.vocab * (2 * a + 12)
    if run.attention_kernel(cfg.model) in ("sdpa", "eager"):
        # Packing keeps SDPA / eager rows at most `length` wide (pipeline.planning.packing): at most
        # micro_batch of them, each with its (length x length) mask.
        parts["attention mask (rows x length^2)"] = run.micro_batch * run.length ** 2 * (1 + a)
    return Estimate(run, shapes.layers, parts)


QUANT_BLOCK = 64  # bitsandbytes' 4-bit block size (weights per absmax constant)
QUANT_NESTED_BLOCK = 256  # double quantization: absmax constants per fp32 constant of their own


def quantized_bytes(kind: str, rows: int, cols: int, double: bool = True) -> int:
    """Bytes bitsandbytes stores for one (rows x cols) linear weight quantized as `kind`.

    nf4 / fp4: two weights per byte, plus the absmax of each block of 64 (fp32, or
    with double quantization one byte each plus an fp32 per 256 blocks); int8: one
    byte per weight plus an fp32 scale per row. (A few hundred bytes per tensor of
    lookup tables and offsets are left out.)
    """
    n = rows * cols
    if kind == "int8":
        return n + 4 * rows
    blocks = -(-n // QUANT_BLOCK)
    constants = blocks + 4 * -(-blocks // QUANT_NESTED_BLOCK) if double else 4 * blocks
    return -(-n // 2) + constants


def _weights(model: ModelConfig, shapes: Shapes, weight_name: str, precision: str, shard: int) -> dict[str, int]:
    """The base weights' parts: one in `weight_name`, or with `model.quantization` the decoder layers'
    linear weights quantized, the rest in `weight_name`, and one dequantized projection in flight."""
    w = _DTYPE_BYTES[weight_name]
    kind = model.quantization
    if kind == "none":
        return {f"weights ({weight_name})": shapes.params * w // shard}
    proj = shapes.linear_projections().values()
    linear = shapes.layers * sum(i * o for i, o in proj)
    stored = shapes.layers * sum(quantized_bytes(kind, o, i, model.quant_double) for i, o in proj)
    double = " + double quant" if model.quant_double and kind != "int8" else ""
    compute = precision if model.quant_compute_dtype == "auto" or kind == "int8" else model.quant_compute_dtype
    rest = "embeddings, norms, head" + (", fused experts" if shapes.experts else "")
    return {f"weights ({kind}{double}: linear layers)": stored // shard,
            f"weights ({weight_name}: {rest})": (shapes.params - linear) * w // shard,
            f"dequantized projection in flight ({compute})": max(i * o for i, o in proj) * _DTYPE_BYTES[compute]}


def _weights_dtype(cfg: TrainConfig, precision: str) -> str:
    if not cfg.lora.enabled:
        return "fp32"
    return precision if cfg.model.dtype == "auto" else cfg.model.dtype


def _targets(lora: LoraConfig, shapes: Shapes) -> list[tuple[int, int]]:
    """(in, out) of each targeted projection of a layer; `[all-linear]` targets every one."""
    proj = shapes.projections()
    names = list(proj) if list(lora.target_modules) == [ALL_LINEAR] else lora.target_modules
    return [proj[t] for t in names if t in proj]


def _lora_params(cfg: TrainConfig, shapes: Shapes) -> int:
    if shapes.counts is not None:
        return shapes.counts.lora
    return shapes.layers * sum(cfg.lora.r * (i + o) for i, o in _targets(cfg.lora, shapes))


def _activation_bytes_per_token(cfg: TrainConfig, shapes: Shapes, run: Run, a: int, residual: int) -> int:
    h, i = shapes.hidden, shapes.intermediate
    if shapes.experts:  # a token runs through its top-k experts and the shared one
        i = shapes.top_k * shapes.expert_intermediate + shapes.shared_intermediate
    q, kv = shapes.heads * shapes.head_dim, shapes.kv_heads * shapes.head_dim
    layer = 2 * (4 * h + a * h) + a * (3 * q + 2 * kv) + 4 * shapes.heads + 4 * a * i
    if run.attention_kernel(cfg.model) == "eager":
        layer += (4 + a) * shapes.heads * run.length
    if cfg.lora.enabled:
        targets = _targets(cfg.lora, shapes)
        layer += sum(cfg.lora.r * a for _ in targets)
        if cfg.lora.dropout > 0:
            layer += sum((a + 1) * fan_in for fan_in, _ in targets)
    outside = (3 * residual + 4 + a) * h  # embeddings out, final norm, the residual's gradient
    k = min(run.checkpointed, shapes.layers)
    # The checkpointed layers come first: the backward reaches them after it freed the later layers'.
    recompute = 2 * layer if k else 0
    return k * residual * h + max((shapes.layers - k) * layer, recompute) + outside


def gpu_precision(mode: str) -> str:
    """The compute dtype `precision.mode` means on a GPU (auto: bf16, as on any recent one)."""
    return "bf16" if mode == "auto" else mode


def budget(gpu_bytes: int, world: int) -> int:
    """Bytes PyTorch's allocator can give a training process on a GPU of `gpu_bytes`: less the CUDA
    context, NCCL's buffers with more than one process, and the fragmentation margin."""
    nccl = NCCL_BYTES if world > 1 else 0
    return int(gpu_bytes * (1 - FRAGMENTATION)) - CUDA_CONTEXT_BYTES - nccl


def checkpointed_layers(cfg: TrainConfig, shapes: Shapes | None, run: Run, limit: int | None) -> int:
    """Decoder layers to checkpoint (the first ones) under `model.activation_checkpointing`:
    on = all, off = none, auto = the fewest whose estimate fits `limit` (bytes), all when none
    does (the smallest estimate; `does_not_fit` then says so), none without a limit or shapes.

    Checkpointing a layer costs its forward again in the backward (about a third of its step time),
    so the fewest layers that fit is the fastest run that fits.
    """
    switch = cfg.model.activation_checkpointing
    layers = shapes.layers if shapes is not None else EVERY_LAYER
    if switch == "on" and shapes is not None and not shapes.checkpointable:
        raise UserError(f"model.activation_checkpointing=on: the model class of {cfg.model.path} cannot checkpoint "
                        "its activations (transformers' supports_gradient_checkpointing is False); set "
                        "model.activation_checkpointing=off, or auto, which then checkpoints nothing")
    if switch != "auto":
        return layers if switch == "on" else 0
    if limit is None or shapes is None or not shapes.checkpointable:
        return 0
    return next((k for k in range(layers + 1)
                 if estimate(cfg, shapes, replace(run, checkpointed=k)).total <= limit), layers)


def decide(cfg: TrainConfig, shapes: Shapes | None, *, world: int, sharded: bool, precision: str, length: int,
           limit: int | None, attention: str | None = None) -> Run:
    """The run a stage trains, activation checkpointing decided: the one function the plan and the
    stage both call, so they estimate the same micro-batch (the derived one, `batch_split`) and
    choose the same layers. `attention`: the resolved `model.attn_implementation`."""
    run = Run(micro_batch=batch_split(cfg, world)[0], length=length, world=world, sharded=sharded,
              checkpointed=0, precision=precision, attention=attention)
    return replace(run, checkpointed=checkpointed_layers(cfg, shapes, run, limit))


# What one H200 measured (bench/results/gpu_check.md, 2026-11-28): Llama-3.2-1B LoRA at length 2048, 16 rows
# per update, as one micro-batch against four: the host's fixed cost is per micro-batch.
MICRO_BATCH_EVIDENCE = ("one micro-batch of 16 rows instead of four of 4 trained 2.4x the tokens/s on an H200 "
                        "(bench/results/gpu_check.md)")


def larger_micro_batch(cfg: TrainConfig, shapes: Shapes, run: Run, budget: int) -> str | None:
    """The line that says a larger `optim.micro_batch` fits `budget` at the run's activation checkpointing
    (the largest that divides a rank's share of the update), or None when none does.

    Each micro-batch costs the host a fixed time (a forward and a backward of many small kernel launches), which
    a GPU spends idle when the micro-batch's own work is short. A larger one changes the order in which an
    update's gradient is summed, not the update (same records, same optim.global_batch): a setting for a new
    run rather than one to change in the middle of one.
    """
    share = cfg.optim.global_batch // run.world
    fits = next((m for m in range(share, run.micro_batch, -1) if share % m == 0
                 and estimate(cfg, shapes, replace(run, micro_batch=m)).total <= budget), None)
    if fits is None:
        return None
    now, then = estimate(cfg, shapes, run).total, estimate(cfg, shapes, replace(run, micro_batch=fits)).total
    return (f"memory: optim.micro_batch={fits} fits too ({then / GiB:.1f} of {budget / GiB:.1f} GiB, "
            f"{checkpointing_text(run.checkpointed, shapes.layers)}) where this run takes {share // run.micro_batch} "
            f"micro-batches of {run.micro_batch} per update ({now / GiB:.1f} GiB). Fewer, larger micro-batches keep a "
            f"GPU busier: {MICRO_BATCH_EVIDENCE}")


def knobs(cfg: TrainConfig, shapes: Shapes, run: Run, budget: int) -> list[str]:
    """What would make a run that does not fit `budget` fit, each with its estimate."""
    lines = []

    def option(text: str, changed: Run, config: TrainConfig = cfg) -> None:
        total = estimate(config, shapes, changed).total
        lines.append(f"  {text}: {total / GiB:.1f} GiB ({'fits' if total <= budget else 'does not fit'})")

    if cfg.lora.enabled and cfg.model.quantization == "none" and not run.sharded:
        option("model.quantization=nf4 (a 4-bit base under LoRA: QLoRA)", run, _with_quantization(cfg, "nf4"))

    full = run.checkpointed >= shapes.layers or not shapes.checkpointable  # no more checkpointing to offer
    if not full:
        option("model.activation_checkpointing=on (or auto)", replace(run, checkpointed=shapes.layers))
    per_update = cfg.optim.global_batch // run.world
    for ckpt in sorted({run.checkpointed, shapes.layers if shapes.checkpointable else run.checkpointed}):
        smaller = [m for m in range(run.micro_batch - 1, 0, -1) if per_update % m == 0]
        fitting = [m for m in smaller if estimate(cfg, shapes, replace(run, micro_batch=m, checkpointed=ckpt)).total
                   <= budget]
        if smaller:
            m = fitting[0] if fitting else smaller[-1]
            extra = " with activation checkpointing" if ckpt == shapes.layers and not full else ""
            option(f"optim.micro_batch={m}{extra} (accumulation keeps optim.global_batch)",
                   replace(run, micro_batch=m, checkpointed=ckpt))
    if not run.sharded and run.world > 1:
        option(f"distributed=fsdp over the {run.world} GPUs", replace(run, sharded=True))
        if not full:
            option(f"distributed=fsdp over the {run.world} GPUs with activation checkpointing",
                   replace(run, sharded=True, checkpointed=shapes.layers))
    elif not run.sharded:
        one = estimate(cfg, shapes, replace(run, checkpointed=shapes.layers, micro_batch=1))
        lines.append(f"  distributed=fsdp with more GPUs (train.nproc): weights, gradients, optimizer and EMA are "
                     f"divided among them ({sum(v for k, v in one.parts.items() if _sharded_part(k)) / GiB:.1f} GiB "
                     "on one GPU)")
    return lines


def _with_quantization(cfg: TrainConfig, kind: str) -> TrainConfig:
    return replace(cfg, model=replace(cfg.model, quantization=Quantization(kind)))


def quantization_note(cfg: TrainConfig, shapes: Shapes, run: Run, budget: int) -> str | None:
    """What the plan says of a quantized run that fits `budget` only because its base is quantized
    (None otherwise: not quantized, not fitting, or fitting with a float base too)."""
    kind = cfg.model.quantization
    if kind == "none" or estimate(cfg, shapes, run).total > budget:
        return None
    float_base = estimate(_with_quantization(cfg, "none"), shapes, run)
    if float_base.total <= budget:
        return None
    return (f"memory: fits only because of model.quantization={kind}: {estimate(cfg, shapes, run).total / GiB:.1f} "
            f"GiB per GPU; with a {_weights_dtype(cfg, run.precision)} base it would be {float_base.total / GiB:.1f} "
            f"GiB, over the {budget / GiB:.1f} GiB budget")


def _sharded_part(name: str) -> bool:
    return name.split(" ")[0] in ("weights", "LoRA", "gradients", "optimizer", "EMA")


def does_not_fit(cfg: TrainConfig, shapes: Shapes, run: Run, budget: int, where: str) -> str | None:
    """None when the run fits `budget`; else the message that says by how much and what to turn."""
    est = estimate(cfg, shapes, run)
    if est.total <= budget:
        return None
    return (f"the run does not fit: {est.total / GiB:.1f} GiB per GPU estimated, {budget / GiB:.1f} GiB {where}.\n"
            f"{est.table()}\nKnobs (train.overrides), each alone:\n" + "\n".join(knobs(cfg, shapes, run, budget)))


def gpus_found() -> tuple[int, int | None]:
    """(count, smallest memory in bytes) of the CUDA GPUs this process sees; (0, None) without any."""
    import torch

    if not torch.cuda.is_available():
        return 0, None
    n = torch.cuda.device_count()
    return n, min(torch.cuda.get_device_properties(i).total_memory for i in range(n))


def longest_record(cache_path: str | None) -> int | None:
    """Tokens of the longest record of a token cache, if it exists yet."""
    if not cache_path or not Path(cache_path).is_file():
        return None
    from pipeline.data.cache import TokenCache

    lengths = TokenCache(cache_path).lengths
    return int(lengths.max()) if lengths.size else None


def gpu_budget(model: ModelConfig, gpu_bytes: int | None, world: int) -> int | None:
    """The allocator's budget per GPU (`budget`) of a GPU of `model.gpu_memory_gb`, else of `gpu_bytes`
    (the GPU found); None with neither (a CPU)."""
    if model.gpu_memory_gb is not None:
        gpu_bytes = int(model.gpu_memory_gb * GiB)
    return None if gpu_bytes is None else budget(gpu_bytes, world)


def for_stage(cfg: TrainConfig, *, device, world: int, sharded: bool, precision: str,
              length: int) -> tuple[int, Estimate | None, str | None]:
    """(decoder layers to checkpoint, the estimate it was decided on, `larger_micro_batch`'s line) for a
    training stage on `device`.

    The GPU's memory is `model.gpu_memory_gb`, else the device's own; a CPU has
    none, so there `auto` means none.
    """
    import torch

    found = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    limit = gpu_budget(cfg.model, found, world)
    needs_shapes = limit is not None or cfg.model.activation_checkpointing != "auto"
    shapes = model_shapes(cfg) if needs_shapes else None
    run = decide(cfg, shapes, world=world, sharded=sharded, precision=precision, length=length, limit=limit,
                 attention=resolved_attention(cfg.model, device) if needs_shapes else None)
    if shapes is None:
        return run.checkpointed, None, None
    hint = larger_micro_batch(cfg, shapes, run, limit) if limit is not None else None
    return run.checkpointed, estimate(cfg, shapes, run), hint


def resolved_attention(model: ModelConfig, device=None) -> str | None:
    """`model.attn_implementation` resolved on `device` (`pipeline.model.attention`); None when the
    model's config cannot be read."""
    from pipeline.model import base

    try:
        return base.attention_choice(model.attn_implementation, base.hf_config(model), device)[0]
    except (OSError, ValueError, UserError):
        return None
