"""Fused kernels for the per-token work of LoRA training, each a setting, each equal to the plain path.

- `lora.fused`: each plain LoRA linear layer runs as `addmm(base(x), x A^T, B^T, alpha=s)`:
  the adapter's second matmul accumulates into the base layer's output in one GEMM,
  instead of peft's `base(x) + lora_B(lora_A(x)) * s` (two more output-sized passes:
  the scale and the add). Needs `lora.dropout=0`; DoRA, quantized and merged layers
  keep peft's forward.
- `model.fused_loss`: the LM head and the cross-entropy as one kernel that never
  writes a (rows x vocab) logits tensor: Liger-Kernel's fused linear cross-entropy
  or Apple's cut-cross-entropy (`pip install -e ".[gpu]"`; both are Triton kernels,
  CUDA only). `auto` takes the first installed on a CUDA run and otherwise the
  chunked loss of `pipeline.model.loss`; a head those kernels cannot take (LoRA on
  the head, trained token rows: not a bare weight) keeps the chunked loss too.
- `model.liger_kernels`: Liger's RMSNorm, SwiGLU MLP and RoPE kernels in the
  decoder, for the families Liger patches (`liger_family`).

Each fused loss is a function `(hidden, weight, bias, targets) -> summed fp32 loss`
with the contract of `torch_linear_cross_entropy`, the torch fallback the CPU tests
run the same wiring with (`FUSED_LOSSES` is where the tests swap it in).
"""

from __future__ import annotations

import importlib.util
import logging
import types

import torch

from pipeline.data.cache import IGNORE_INDEX
from pipeline.errors import UserError

log = logging.getLogger(__name__)

FUSED_LOSS_PACKAGES = {"liger": "liger_kernel", "cce": "cut_cross_entropy"}  # setting value -> import name


# --- fused LoRA linear layers ------------------------------------------------------------------------


def fuse_lora(model) -> int:
    """Give every plain LoRA linear layer of the (PEFT) `model` the fused forward; returns how many.

    Plain: peft's `lora.Linear` itself (not a bitsandbytes or other subclass), one
    adapter, no DoRA, no dropout, no LoRA bias. Its parameters, their names and
    what is saved do not change, only how the forward computes.
    """
    from peft.tuners.lora.layer import Linear

    fused = 0
    for module in model.modules():
        if type(module) is Linear and _plain(module):
            module.forward = types.MethodType(_fused_forward, module)
            fused += 1
    return fused


def _plain(layer) -> bool:
    if len(layer.lora_A) != 1:
        return False
    name = next(iter(layer.lora_A))
    dropout = layer.lora_dropout[name]
    return (name not in getattr(layer, "lora_variant", {}) and not layer.use_dora.get(name, False)
            and (isinstance(dropout, torch.nn.Identity) or getattr(dropout, "p", 1.0) == 0.0)
            and layer.lora_B[name].bias is None and not getattr(layer, "fan_in_fan_out", False))


def _fused_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """`base(x) + s * B A x` with the B matmul accumulating into the base output (`torch.addmm`)."""
    (name,) = self.lora_A.keys()
    if self.disable_adapters or self.merged or name not in self.active_adapters or kwargs.get("adapter_names"):
        return type(self).forward(self, x, *args, **kwargs)
    a, b = self.lora_A[name].weight, self.lora_B[name].weight
    if x.dtype != a.dtype and not _autocast(x.device.type):  # peft casts the input up then: let it
        return type(self).forward(self, x, *args, **kwargs)
    result = self.base_layer(x, *args, **kwargs)
    flat = x.reshape(-1, x.shape[-1])
    out = torch.addmm(result.reshape(-1, result.shape[-1]), flat @ a.t(), b.t(), alpha=self.scaling[name])
    return out.view(result.shape).to(result.dtype)


def _autocast(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4 took no device type
        return torch.is_autocast_enabled() if device_type == "cuda" else torch.is_autocast_cpu_enabled()


# --- fused linear cross-entropy ------------------------------------------------------------------------


def torch_linear_cross_entropy(hidden, weight, bias, targets) -> torch.Tensor:
    """The contract every fused loss meets, in plain torch: sum over rows of CE(hidden W^T + b, target)
    in fp32 (targets `IGNORE_INDEX` add nothing). The fallback the CPU tests run the wiring with."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    return torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _liger(hidden, weight, bias, targets) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(hidden, weight, targets, bias=bias, ignore_index=IGNORE_INDEX,
                                            reduction="sum", accum_dtype=torch.float32).float()


def _cce(hidden, weight, bias, targets) -> torch.Tensor:
    from cut_cross_entropy import linear_cross_entropy

    if bias is not None:
        raise UserError("model.fused_loss=cce: cut-cross-entropy takes no output-head bias; use liger or chunked")
    return linear_cross_entropy(hidden, weight, targets, ignore_index=IGNORE_INDEX, reduction="sum").float()


FUSED_LOSSES = {"liger": _liger, "cce": _cce}


def installed(choice: str) -> bool:
    return importlib.util.find_spec(FUSED_LOSS_PACKAGES[choice]) is not None


def fused_loss(choice: str, head: torch.nn.Module, device: torch.device):
    """The fused loss function `model.fused_loss=<choice>` runs with this head on this device, or None
    for the chunked loss. `auto`: liger, else cce, where installed, on CUDA. A named kernel that
    is not installed, or used off CUDA without a fallback, is a UserError."""
    choice = str(choice)
    if choice == "chunked":
        return None
    bare = type(head) is torch.nn.Linear  # a LoRA- or token-adapted head is not one weight
    half = bare and head.weight.dtype in (torch.bfloat16, torch.float16)
    if choice == "auto":
        usable = [c for c in FUSED_LOSSES if installed(c) and (half or c != "cce")]
        found = usable[0] if usable and device.type == "cuda" else None
        if found is None or not bare:
            return None
        choice = found
    if not bare:
        log.warning("model.fused_loss=%s: the output head is a %s (adapted), not a bare Linear; using the "
                    "chunked loss", choice, type(head).__name__)
        return None
    if FUSED_LOSSES[choice] in (_liger, _cce):  # the real kernels (tests may put a fallback there)
        if FUSED_LOSSES[choice] is _cce and not half:  # its backward asserts it (seen on an H200, cce 25.1.1)
            raise UserError(f"model.fused_loss=cce: cut-cross-entropy's backward needs the output head in bf16 or "
                            f"fp16 (precision.mode=bf16 | fp16), and this one is {head.weight.dtype}: use "
                            "model.fused_loss=liger | chunked")
        if not installed(choice):
            raise UserError(f"model.fused_loss={choice}: {FUSED_LOSS_PACKAGES[choice]} is not installed "
                            "(pip install -e \".[gpu]\"), or use model.fused_loss=auto | chunked")
        if device.type != "cuda":
            raise UserError(f"model.fused_loss={choice} runs Triton kernels on CUDA only; this run is on "
                            f"{device.type}: use model.fused_loss=auto | chunked")
    return FUSED_LOSSES[choice]


# --- Liger's decoder kernels ---------------------------------------------------------------------------


def liger_family(model) -> str | None:
    """The model type Liger can patch (its `MODEL_TYPE_TO_APPLY_LIGER_FN`), or None."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    kind = getattr(model.config, "model_type", None)
    return kind if kind in MODEL_TYPE_TO_APPLY_LIGER_FN else None


def apply_liger(model) -> None:
    """Liger's RMSNorm, SwiGLU and RoPE kernels in the decoder of the (not yet PEFT-wrapped) `model`
    (its loss stays ours: `model.fused_loss`). UserError where Liger is not installed or does not
    patch the family."""
    if importlib.util.find_spec("liger_kernel") is None:
        raise UserError("model.liger_kernels=true needs Liger-Kernel: pip install -e \".[gpu]\"")
    if liger_family(model) is None:
        raise UserError(f"model.liger_kernels=true: Liger-Kernel has no kernels for the model type "
                        f"{getattr(model.config, 'model_type', None)!r}; set model.liger_kernels=false")
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
