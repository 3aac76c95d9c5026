"""The next-token loss of a micro-batch, and validation loss.

Shared by training (`pipeline.train`) and evaluation (`pipeline.evaluate`), so
both compute the loss the same way. Labels carry `IGNORE_INDEX` on every
position that is not supervised (prompts, image tokens, padding).

The loss never builds a (tokens x vocab) tensor. `TokenLoss` runs the model's
decoder for hidden states only, picks the positions whose next token is
supervised (their indices are computed on the CPU when the batch is collated,
so picking them costs no host sync), and runs the LM head and the
cross-entropy over those rows in chunks of `chunk_tokens`: each chunk's logits
are recomputed in the backward (`torch.utils.checkpoint`), so at most one
chunk's logits exist at a time. On CUDA the chunk's function is compiled, each
chunk padded to one row count (one graph); elsewhere it runs eagerly. The numbers are those of a full-vocabulary fp32
cross-entropy over the whole batch, up to the order of the sums.

The micro-batches it takes (`Batch`: padded, packed rows, or one flat row; a
vision-language model's with its image inputs) are made in `pipeline.model.batch`.
`TokenLoss` passes every input to the decoder, so a vision-language model's
vision tower and projector run inside the same forward.
"""

from __future__ import annotations

import contextlib
import logging
import functools
import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from pipeline import compat
from pipeline.data.cache import IGNORE_INDEX
from pipeline.data.vision import config_is_vision_language
from pipeline.errors import UserError
from pipeline.model import kernels, router, row_masks
# Batches moved to pipeline.model.batch; the names stay importable from here, where callers found them.
from pipeline.model.batch import Batch, Collator, collate  # noqa: F401

# Logits elements per chunk of the loss (2**25 fp32 = 128 MiB; the backward holds about
# four such tensors): ~260 rows at a 128k vocabulary, still enough to keep the head matmul
# efficient on a GPU; ~1,000 at 32k.
log = logging.getLogger(__name__)

CHUNK_LOGITS = 2**25

# Causal text decoders (`config.model_type`) whose attention mask only hides keys, and whose
# position ids are 0..width-1 whatever the mask says. In a right-padded batch the mask is then
# not needed for the positions the loss reads: a real token sees only earlier positions, all
# real, and the padding after it is never a loss position. Without the mask SDPA takes its
# causal kernel (flash or memory-efficient on a GPU) and does not repeat grouped K/V heads.
# Not in the list: vision-language models (Qwen2-VL derives its 3-D positions from the mask),
# and any family not checked (`tests/model/test_mask_free.py` compares masked and mask-free).
MASK_FREE_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt2", "olmo2", "olmo3",
                                "smollm3", "gemma3_text", "gemma4_text", "granite", "exaone4", "ernie4_5", "seed_oss",
                                "apertus", "hunyuan_v1_dense", "ministral", "ministral3", "glm", "arcee", "cohere2",
                                "gemma4_unified_text", "apertus1p5_text", "jais2", "helium", "nanochat", "cwm",
                                "hyperclovax", "dory", "iquestcoder", "phi", "starcoder2", "internlm3"})


def hf_model(lm) -> torch.nn.Module:
    """The Hugging Face model under a PEFT wrapper (or `lm` itself)."""
    return lm.get_base_model() if hasattr(lm, "get_base_model") else lm


def body(hf) -> torch.nn.Module:
    """The model without its LM head: the module whose output has `last_hidden_state`.

    Its `base_model`, where the model's `base_model_prefix` names a child. Llama-4's
    text-only `Llama4ForCausalLM` names `language_model` (its multimodal parent's name)
    but keeps its body in `model`, so `base_model` is the whole causal LM there: then the
    one child that is a Hugging Face model itself."""
    if hf.base_model is not hf:
        return hf.base_model
    from transformers import PreTrainedModel

    inner = [m for m in hf.children() if isinstance(m, PreTrainedModel)]
    if len(inner) != 1:
        raise ValueError(f"{type(hf).__name__}: no decoder body found (base_model_prefix "
                         f"{hf.base_model_prefix!r} names no child, and {len(inner)} children are models)")
    return inner[0]


@dataclass(frozen=True)
class LogitMap:
    """What a model's own forward does to its LM head's output before the softmax: multiply by
    `scale`, then, with a `cap`, soft-cap (cap * tanh(logits / cap)). The loss does the same to each
    chunk's logits, so it trains the model that generates and is evaluated."""

    scale: float = 1.0
    cap: float | None = None

    def __bool__(self) -> bool:
        return self.scale != 1.0 or self.cap is not None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return _mapped(logits, self.scale, self.cap or 0.0)

    def __str__(self) -> str:
        parts = ([f"x {self.scale:g}"] if self.scale != 1.0 else []) + ([f"soft-capped at {self.cap:g}"]
                                                                         if self.cap is not None else [])
        return ", then ".join(parts) or "as the head gives them"


# Text model type -> its causal LM's step after the head, from its config, as the stock forward does it
# (transformers' modeling_<type>.py). Granite divides by `logits_scaling`; HyperCLOVA X multiplies by it.
# A composite's step is read off its text config's type: Mistral Large 4's is `mistral_large4_text`.
_SOFTCAP = ("gemma2", "gemma3_text", "gemma3n_text", "gemma4_text", "mistral_large4", "mistral_large4_text",
            "nanochat", "vaultgemma", "beam")
_LOGIT_MAPS = {
    **{t: lambda c: LogitMap(cap=getattr(c, "final_logit_softcapping", None) or None) for t in _SOFTCAP},
    **{t: lambda c: LogitMap(scale=float(c.logit_scale)) for t in ("cohere", "cohere2", "cohere2_moe")},
    **{t: lambda c: LogitMap(scale=1.0 / float(c.logits_scaling))
       for t in ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "granitemoe_swa",
                 "granite4_vision_text")},
    # Cohere Compass's composite multiplies by its text model's logit_scale where one is set
    "cohere_compass_text": lambda c: LogitMap(scale=float(c.logit_scale) if c.logit_scale is not None else 1.0),
    "falcon_h1": lambda c: LogitMap(scale=float(c.lm_head_multiplier)),
    "hyperclovax": lambda c: LogitMap(scale=float(c.logits_scaling)),
    "recurrent_gemma": lambda c: LogitMap(cap=getattr(c, "logits_soft_cap", None) or None),
    "xlstm": lambda c: LogitMap(cap=getattr(c, "output_logit_soft_cap", None) or None),
    # these divide the last hidden states before the head (no bias): the same as dividing its logits
    "minicpm3": lambda c: LogitMap(scale=float(c.dim_model_base) / float(c.hidden_size)),
    "inkling_text": lambda c: LogitMap(scale=1.0 / float(c.logits_mup_width_multiplier)),
}


def logit_map(config) -> LogitMap:
    """The step `config`'s model takes after its LM head (`LogitMap`; none for most families). A
    vision-language model's is its text model's, unless its own forward leaves it out (Aya Vision's and
    Granite Vision's give the head's output as it is): `TokenLoss.check_head` finds that on its probe."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = _LOGIT_MAPS.get(getattr(text, "model_type", None))
    if found:
        return found(text)
    # A family not listed that names a soft cap the way Gemma 2 does: capped, as its forward does. At random init
    # the logits are too small for the head probe (`TokenLoss.check_head`) to see a cap of 30.
    return LogitMap(cap=getattr(text, "final_logit_softcapping", None) or None)


# Text model type -> the attribute naming a module its causal LM applies to the last hidden states before the
# output embedding (`get_output_embeddings`), as the stock forward does: ModernBERT-decoder's prediction head
# (dense, activation, norm), which is per token, so the loss applies it to the rows it picks.
_PRE_HEADS = {"modernbert-decoder": "lm_head"}


def pre_head(hf) -> torch.nn.Module | None:
    """The module `hf`'s forward applies between its decoder's last hidden states and its output embedding
    (`_PRE_HEADS`), or None: for most families the head takes the hidden states as they are."""
    name = _PRE_HEADS.get(getattr(hf.config, "model_type", None))
    return getattr(hf, name) if name else None


def chunk_tokens(vocab_size: int) -> int:
    """Rows per loss chunk: `CHUNK_LOGITS` logits elements."""
    return max(1, CHUNK_LOGITS // max(vocab_size, 1))


class TokenLoss(torch.nn.Module):
    """The model as the training loop and the evaluations call it: a batch in, the summed loss out.

    `forward(batch)` returns the sum over the batch's supervised positions of
    the next-token cross-entropy (a float32 scalar), computed as the module
    docstring says. It is the module that DDP wraps and that FSDP shards as its
    root, so the LM head runs inside the wrapped forward (where FSDP has its
    weight gathered and DDP its hooks ready). `lm` is the model (PEFT-wrapped
    under LoRA): the optimizer, the EMA and the checkpoints see that one.

    The step some families take after the head (soft-capping, a logit scale:
    `logit_map`) is taken on each chunk's logits too. Construction checks once,
    on a short probe, that the model's logits are its LM head applied to its
    decoder's last hidden states, then that step (no other step after the head
    that this loss would skip).
    """

    def __init__(self, lm, *, chunk: int | None = None, check: bool = True, mask_free: bool | None = None,
                 fused_loss: str = "chunked"):
        """`check`: probe the LM head now (`check_head`); a caller whose weights are not loaded
        yet (an FSDP skeleton) passes False and calls `check_head()` once they are.
        `mask_free`: leave padded batches' attention mask out; None decides by the model's family
        (`can_drop_mask`); benchmarks and tests force either way. `fused_loss`: the
        `model.fused_loss` setting (`pipeline.model.kernels.fused_loss`: a fused kernel for
        the head and the cross-entropy, or None for the chunked loss)."""
        super().__init__()
        self.lm = lm
        head = hf_model(lm).get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(hf_model(lm)).__name__} has no output embeddings (LM head)")
        self.chunk = chunk or chunk_tokens(head.weight.shape[0])
        self.logits = logit_map(hf_model(lm).config)
        if self.logits and str(fused_loss) in kernels.FUSED_LOSSES:
            raise UserError(f"model.fused_loss={fused_loss}: {hf_model(lm).config.model_type} takes its logits "
                            f"{self.logits} after the head, which the fused kernels leave out: use "
                            "model.fused_loss=auto | chunked (the chunked loss does the same step)")
        self.fused = None if self.logits else kernels.fused_loss(fused_loss, head, head.weight.device)
        self.mask_free = can_drop_mask(hf_model(lm)) if mask_free is None else mask_free
        # A mixture-of-experts model's load-balancing loss, added in training (`pipeline.model.router`);
        # `router_sum` collects its weighted values (detached) until the update takes them.
        self.router = router.defined(hf_model(lm))
        self.router_sum: torch.Tensor | None = None
        if check:
            self.check_head()

    def forward(self, batch: Batch, *, probe: bool = False) -> torch.Tensor:
        if probe:  # inside this module's forward, so FSDP has the root's weights gathered
            return _probe_logits(hf_model(self.lm), batch.inputs["input_ids"])
        hf = hf_model(self.lm)
        inputs = batch.inputs
        # Right padding only (`_padded`), see MASK_FREE_FAMILIES; a packed row keeps its position ids,
        # from which the attention keeps its sequences apart.
        mask_free = self.mask_free and "position_ids" not in inputs
        if mask_free:
            inputs = {k: v for k, v in inputs.items() if k != "attention_mask"}
        else:
            inputs = row_masks.with_row_masks(hf, inputs)
        # The decoder alone (LoRA layers are inside it): hidden states, no logits, no KV cache. A
        # mask-free forward skips transformers' mask builder, which would read the position ids back
        # to the host (a device sync per forward) to look for packed sequences there are none of.
        balance = self.router is not None and self.training
        extra = {"output_router_logits": balance} if self.router is not None else {}
        with compat.skip_mask_builder(hf) if mask_free else contextlib.nullcontext():
            out = body(hf)(**inputs, use_cache=False, **extra)
        picked = out.last_hidden_state.flatten(0, 1).index_select(0, batch.loss_index)
        if (before := pre_head(hf)) is not None:
            picked = before(picked)
        head = hf.get_output_embeddings()
        if self.fused is not None and picked.shape[0]:  # (an empty batch: the chunked loss reaches every weight)
            loss = self.fused(picked, head.weight, head.bias, batch.targets)
        else:
            loss = linear_cross_entropy_sum(picked, head, batch.targets, self.chunk, logits=self.logits)
        if balance:  # + coef * load-balancing loss * supervised tokens (`pipeline.model.router`)
            # over the real tokens: a padded batch's mask, a packed row's `real` (the padding that fills it)
            added, weighted = self.router.term(out.router_logits, batch.real_tokens(), batch.supervised)
            loss = loss + added
            self.router_sum = weighted if self.router_sum is None else self.router_sum + weighted
        return loss

    def take_router_sum(self) -> torch.Tensor | None:
        """The weighted load-balancing losses added since the last call (None: none added), and reset."""
        taken, self.router_sum = self.router_sum, None
        return taken

    @torch.no_grad()
    def check_head(self) -> None:
        """Check on a short probe that the model's logits are its LM head applied to its decoder's
        last hidden states, then its `logit_map`; ValueError if not. A composite model whose forward
        gives the head's output without its text model's step (Aya Vision, Granite Vision) trains
        without it. Collective when the module is FSDP-sharded."""
        hf = hf_model(self.lm)
        was_training = self.lm.training  # the model's mode, not this (fresh) wrapper's
        self.eval()
        weight = hf.get_output_embeddings().weight
        ids = _probe_ids(hf.config, weight.shape[0], weight.device)
        # Half-precision weights train under autocast (LoRA inputs are then left uncast): probe likewise.
        half = weight.dtype in (torch.float16, torch.bfloat16)
        try:
            with torch.autocast(weight.device.type, dtype=weight.dtype) if half else contextlib.nullcontext():
                logits, head = self(Batch({"input_ids": ids}, ids[0, :0], ids[0, :0], tokens=8), probe=True)
        finally:
            self.train(was_training)
        if not torch.isfinite(logits).all():
            raise ValueError(f"{type(hf).__name__}: its logits on an 8-token probe, before any update, are not finite"
                             f"{_zero_row_dora(hf)}")
        ours = self.logits(head)
        if self.logits and not torch.allclose(logits, ours, rtol=1e-3, atol=1e-3) and torch.allclose(
                logits, head, rtol=1e-3, atol=1e-3):
            log.info("%s gives its LM head's logits as they are, without its text model's step (%s): the loss "
                     "does likewise", type(hf).__name__, self.logits)
            self.logits, ours = LogitMap(), head
        if not torch.allclose(logits, ours, rtol=1e-3, atol=1e-3):
            raise ValueError(
                f"{type(hf).__name__}: the logits are not the LM head applied to the last hidden states"
                f"{f' (then {self.logits})' if self.logits else ''} (max difference "
                f"{float((logits - ours).abs().max()):.3g}); the chunked loss would train another model than the "
                "one evaluated. Models that post-process their logits in another way are not supported.")


def _zero_row_dora(model) -> str:
    """Why a model's first logits are not finite, where DoRA is the cause: it divides by the norm of each
    row of an adapted weight, and a row of zeros (xLSTM's gate projections at their init) gives NaN."""
    zero = [name for name, module in model.named_modules()
            if getattr(module, "lora_magnitude_vector", None) and hasattr(module, "get_base_layer")
            and getattr(module.get_base_layer(), "weight", None) is not None
            and module.get_base_layer().weight.device.type != "meta"
            and bool((module.get_base_layer().weight.detach().float().norm(dim=1) == 0).any())]
    if not zero:
        return ""
    shown = ", ".join(zero[:4]) + (f" and {len(zero) - 4} more" if len(zero) > 4 else "")
    return (f": DoRA (lora.use_dora) divides by the norm of each row of an adapted weight, and {shown} have rows "
            "of zeros; leave them out of lora.target_modules or set lora.use_dora=false")


def can_drop_mask(model) -> bool:
    """Can `model`'s right-padded text batches go without their attention mask (`MASK_FREE_FAMILIES`)?"""
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) in MASK_FREE_FAMILIES and not config_is_vision_language(config)


def linear_cross_entropy_sum(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor,
                             chunk: int, *, compiled: bool | None = None, logits: LogitMap = LogitMap()
                             ) -> torch.Tensor:
    """sum_i CE(logits(head(hidden[i])), targets[i]) in fp32, `chunk` rows at a time (`logits`: the
    model's step after its head, `LogitMap`).

    Under autograd each chunk is checkpointed: its logits are freed after the
    forward and recomputed (with the same autocast state) in the backward.
    Always runs at least one (maybe empty) chunk, so the result depends on
    every parameter even for a batch with nothing supervised (DDP needs every
    gradient on every rank).

    `compiled` (default: on CUDA) runs each chunk through `_compiled_chunk_loss`,
    every chunk padded to `chunk` rows (zero hidden states, ignored targets: they add
    nothing to the sum or the gradients). One shape, so one compiled graph for the
    whole run: the last chunk's row count changes with every micro-batch, and each
    new count compiled again (a stall mid-run that can trip the throughput alert).
    The padding costs at most one chunk's head matmul per micro-batch.
    """
    n = hidden.shape[0]
    grad = torch.is_grad_enabled()
    compiled = hidden.device.type == "cuda" if compiled is None else compiled
    loss = _compiled_chunk_loss() if compiled else _chunk_loss
    total = None
    for start in range(0, max(n, 1), chunk):
        h, t = hidden[start:start + chunk], targets[start:start + chunk]
        if compiled and h.shape[0] < chunk:
            h = torch.nn.functional.pad(h, (0, 0, 0, chunk - h.shape[0]))
            t = torch.nn.functional.pad(t, (0, chunk - t.shape[0]), value=IGNORE_INDEX)
        mapped = (logits.scale, logits.cap or 0.0)
        part = checkpoint(loss, head, h, t, *mapped, use_reentrant=False) if grad else loss(head, h, t, *mapped)
        total = part if total is None else total + part
    return total


def _chunk_loss(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, scale: float = 1.0,
                cap: float = 0.0) -> torch.Tensor:
    """One chunk's summed cross-entropy; its logits x `scale`, then soft-capped at `cap` (0: not)."""
    return torch.nn.functional.cross_entropy(_mapped(head(hidden).float(), scale, cap), targets,
                                             ignore_index=IGNORE_INDEX, reduction="sum")


def _mapped(logits: torch.Tensor, scale: float, cap: float) -> torch.Tensor:
    """`logits` x `scale`, then soft-capped at `cap` (0: not): `LogitMap`'s step."""
    if scale != 1.0:
        logits = logits * scale
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def chunk_loss_for(device: torch.device):
    """The function computing one chunk's loss on `device`: `_chunk_loss` as it is on a CPU (and
    any device but CUDA), compiled on CUDA (`_compiled_chunk_loss`)."""
    return _compiled_chunk_loss() if device.type == "cuda" else _chunk_loss


# The torch.compile backend of the chunk loss (tests count its graphs with a counting backend).
COMPILE_BACKEND = "inductor"


@functools.cache
def _compiled_chunk_loss():
    """`_chunk_loss` through `torch.compile`, for CUDA.

    Eager, the chunk's logits are written in the compute dtype, copied to fp32,
    and log-softmaxed into a third (tokens x vocab) tensor, all in HBM; compiled,
    the cast, log-sum-exp and target pick fuse into kernels that read the
    logits once (in the forward and again in the checkpoint's recompute). The
    head's matmul stays cuBLAS's. Any head module works (LoRA-adapted, trainable
    token rows), unlike fused linear-cross-entropy kernels that take a bare
    weight. Static shapes (`dynamic=False`): `linear_cross_entropy_sum` pads every
    chunk to one row count. Not measured on a GPU yet. `TORCHDYNAMO_DISABLE=1`
    runs it eagerly.
    """
    return torch.compile(_chunk_loss, backend=COMPILE_BACKEND, dynamic=False)


def _probe_ids(config, vocab: int, device) -> torch.Tensor:
    """Eight token ids for the head probe: text only (an image token without its image would
    not match any image features in a vision-language model)."""
    special = {getattr(config, k, None) for k in ("image_token_id", "video_token_id", "image_token_index")}
    ids = [i % vocab for i in range(8 + len(special)) if i % vocab not in special][:8]
    return torch.tensor(ids, device=device).unsqueeze(0)


def _probe_logits(hf, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own logits, and its LM head applied to its decoder's last hidden states (through its
    `pre_head`, where it has one)."""
    logits = hf(input_ids=ids, use_cache=False).logits.float()
    hidden = body(hf)(input_ids=ids, use_cache=False).last_hidden_state
    before = pre_head(hf)
    return logits, hf.get_output_embeddings()(hidden if before is None else before(hidden)).float()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over supervised positions, from full logits, in fp32.

    The reference `TokenLoss` must equal (the loss before it existed); kept for tests and
    benchmarks, not used by training or evaluation.
    """
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def num_batches(cache, micro_batch: int, max_batches: int | None = None) -> int:
    """Batches of `micro_batch` records the validation cache splits into (at most `max_batches`)."""
    n = -(-len(cache) // micro_batch)
    return n if max_batches is None else min(n, max_batches)


@torch.no_grad()
def batch_loss_sums(loss_model: TokenLoss, collator: Collator, batch_ids: list[int], *, micro_batch: int, device,
                    autocast, should_stop=None) -> list[tuple[float, int]] | None:
    """(loss sum, supervised tokens) of each batch in `batch_ids`; batch b holds records
    [b * micro_batch, (b + 1) * micro_batch) of the collator's cache, collated as in training.

    Runs in eval mode (no dropout) and consumes no RNG, so evaluating inside a
    stage does not change what training computes afterwards. `should_stop()` is
    asked before each batch; when it says yes the evaluation is abandoned and
    None returned (a preemption signal arrived meanwhile). One host sync, at the end.
    """
    was_training = loss_model.training
    loss_model.eval()
    sums, tokens = [], []
    try:
        for b in batch_ids:
            if should_stop is not None and should_stop():
                return None
            records = list(range(b * micro_batch, min(len(collator.cache), (b + 1) * micro_batch)))
            batch = collator(records).to(device)
            with autocast():
                sums.append(loss_model(batch).float())
            tokens.append(batch.supervised)
    finally:
        loss_model.train(was_training)
    return list(zip(torch.stack(sums).tolist(), tokens)) if sums else []


def mean_loss(sums: list[tuple[float, int]]) -> dict:
    """Token-weighted mean loss and perplexity of per-batch (loss sum, tokens), summed in batch order."""
    total, tokens = 0.0, 0
    for loss, n in sums:
        total += loss
        tokens += n
    loss = total / max(tokens, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens}


def validation_loss(loss_model: TokenLoss, collator: Collator, *, micro_batch: int, device, autocast) -> dict:
    """Token-weighted mean loss over the collator's whole cache, in this process (see `batch_loss_sums`)."""
    ids = list(range(num_batches(collator.cache, micro_batch)))
    return mean_loss(batch_loss_sums(loss_model, collator, ids, micro_batch=micro_batch, device=device,
                                     autocast=autocast))
