"""SDPA record by record: how packed micro-batches keep their records apart on a CPU.

A packed micro-batch in one flat row (`pipeline.model.batch`, layout "records")
holds several records back to back, their boundaries given as plain ints
(`RECORD_BOUNDS`, computed by the collator: nothing is read back from a tensor). Under SDPA with the block-causal mask
transformers builds from the position ids, the CPU kernel computes every
(query, key) pair of a row and masks those across records; run record by record
with its causal kernel, it computes only each record's lower triangle, and the
flat row needs no padding and no mask at all (about 1.5x the tokens/s of a
forward + backward at rows of 511 tokens holding two records each, demo
architecture, one CPU thread). On a GPU flash-attention's varlen kernel does
the same in one call (`pipeline.planning.packing`); there a loop of small
kernels per record would not pay.

`use(model)` switches a transformers model to `NAME`, registered with
transformers' `AttentionInterface`. No mask function is registered for it, so
transformers builds no mask at all for that model: a flat packed batch is kept
apart by its boundaries, and any other batch runs causally without a mask.
That is exact only for a right-padded text decoder whose mask only hides keys
and whose positions do not depend on it (`pipeline.model.loss.can_drop_mask`:
its padding is never a loss position), and without a sliding window narrower
than its records: `runs_per_record` says which models qualify, and only those
are switched (in the training process only: evaluation jobs load the model as
configured).

On a GPU the same switch can run the flat row through torch's own flash-attention
varlen kernel (`torch.nn.attention.varlen.varlen_attn`, torch >= 2.10) in one
call, its boundaries given as `cu_seq_lens` (`tokens.torch_varlen`): flash
attention's packing without the flash-attn package, where SDPA would otherwise
keep a packed row's records apart with a dense block-causal mask. `varlen_fits`
says where it applies (half-precision compute, a head size the kernel takes, no
attention dropout, no logit soft-capping); the kernel has no CPU implementation.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from pipeline.compat import per_layer
from pipeline.model.attention import head_sizes
from pipeline.model.batch import RECORD_BOUNDS
from pipeline.model.loss import MASK_FREE_FAMILIES

NAME = "sft_sdpa_per_record"


def runs_per_record(config, longest: int) -> bool:
    """Can a text model of `config` (a transformers config) attend record by record without any mask,
    its records at most `longest` tokens? A mask-free family (`MASK_FREE_FAMILIES`) whose sliding
    window, if any, covers every record (then it equals the causal mask)."""
    if getattr(config, "model_type", None) not in MASK_FREE_FAMILIES:  # text decoders only (packing is)
        return False
    windows = [w for w in per_layer(config, "sliding_window") if w is not None]
    used = getattr(config, "use_sliding_window", True)  # Qwen2/3 keep a window in the config, unused by default
    return not used or all(window >= longest for window in windows)


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, per record when the batch gives its boundaries as ints (one flat
    row: query (1, heads, tokens, dim)); torch's varlen kernel when it gives them as `cu_seq_lens`
    tensors (a GPU, `tokens.torch_varlen`); as is otherwise. Output as transformers' (batch, tokens, heads, dim)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    edges = kwargs.pop(RECORD_BOUNDS, None)
    if edges is None and kwargs.get("cu_seq_lens_q") is not None:
        return _varlen(query, key, value, kwargs["cu_seq_lens_q"], int(kwargs["max_length_q"]),
                       scaling=kwargs.get("scaling"), dropout=kwargs.get("dropout", 0.0))
    if edges is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    parts = [sdpa_attention_forward(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None, is_causal=True,
                                    **kwargs)[0] for s, e in zip(edges, edges[1:])]
    return torch.cat(parts, dim=1), None


def use(model) -> None:
    """Switch the transformers `model` (not a peft wrapper) to `NAME`: record by record, or through torch's
    varlen kernel, as each flat batch gives its boundaries (`attention`). RuntimeError if the model
    cannot switch implementations (its family does not use transformers' attention interface)."""
    from transformers import AttentionInterface

    global _KERNEL
    _KERNEL = _Kernel.here() if torch_varlen_kernel() is not None else None
    AttentionInterface.register(NAME, attention)
    model.set_attn_implementation(NAME)
    if model.config._attn_implementation != NAME:
        raise RuntimeError(f"{type(model).__name__} cannot switch its attention implementation to {NAME}")


def torch_varlen_kernel():
    """torch's flash-attention varlen function (`torch.nn.attention.varlen.varlen_attn`), or None where
    this torch has none (before 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def varlen_fits(config, compute_dtype) -> str | None:
    """Why torch's varlen kernel cannot run the attention of a model of `config` (a transformers config;
    a vision-language model's text config is read) under `compute_dtype` (the autocast dtype; None:
    fp32), or None where it can. The flash kernel takes half-precision inputs and head sizes up to 256
    in multiples of 8, and has no dropout or soft-capping of its logits."""
    if torch_varlen_kernel() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.10)"
    if compute_dtype not in (torch.bfloat16, torch.float16):
        return "its flash kernel computes in bf16 or fp16 only (precision.mode gives fp32)"
    for head_dim in sorted(head_sizes(config), key=lambda size: -(size or 0)):  # Gemma 4: 512 in some layers
        if not head_dim or head_dim % 8 or head_dim > 256:
            return f"head size {head_dim}: its flash kernel takes multiples of 8 up to 256"
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return f"attention_dropout {config.attention_dropout} in the model's config: the kernel has no dropout"
    if getattr(config, "attn_logit_softcapping", None):
        return "its attention logits are soft-capped (attn_logit_softcapping), which the kernel does not do"
    return None


@dataclass(frozen=True)
class _Kernel:
    """`torch_varlen_kernel` and the names of its parameters, read once (`use`), not in every layer's
    forward (which torch.compile would trace)."""

    function: object
    params: frozenset[str]

    @classmethod
    def here(cls) -> _Kernel:
        function = torch_varlen_kernel()
        return cls(function, frozenset(inspect.signature(function).parameters))


_KERNEL: _Kernel | None = None  # set by `use` where this torch has the kernel


def _varlen(query, key, value, bounds, longest: int, *, scaling, dropout) -> tuple[torch.Tensor, None]:
    """One flat row (query (1, heads, tokens, dim), key / value (1, kv heads, tokens, dim)) through
    `torch_varlen_kernel`, causal within each record of `bounds` (cu_seq_lens, int32). Adapts to the
    signatures torch has had: a causal flag (2.10) or a window (2.11 on), GQA asked for or not, a
    scale or not. Returns transformers' (1, tokens, heads, dim)."""
    if dropout:
        raise RuntimeError(f"torch's varlen attention has no dropout (got {dropout}): tokens.torch_varlen needs "
                           "attention_dropout 0")
    if _KERNEL is None:  # `use` found no kernel in this torch, or was not called
        raise RuntimeError(f"a flat batch with cu_seq_lens reached {NAME}, but torch {torch.__version__} has no "
                           "torch.nn.attention.varlen loaded by packed_attention.use (tokens.torch_varlen needs it)")
    kernel, params = _KERNEL.function, _KERNEL.params
    # Autocast does not cast a custom op's inputs (it does SDPA's): the projections and the rotary
    # embedding may hand over different dtypes. Compute in the autocast dtype, as SDPA would.
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else value.dtype
    q, k, v = (t[0].transpose(0, 1).to(dtype).contiguous() for t in (query, key, value))  # (tokens, heads, dim)
    options = {}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            options["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if "window_size" in params:
        options["window_size"] = (-1, 0)  # causal
    else:
        options["is_causal"] = True
    if scaling is not None:
        if "scale" in params:
            options["scale"] = scaling
        else:
            q = q * (scaling * q.shape[-1] ** 0.5)  # the kernel's own scale is 1 / sqrt(dim)
    out = kernel(q, k, v, bounds, bounds, longest, longest, **options)
    return out.unsqueeze(0), None
