"""A quantized frozen base under LoRA (QLoRA, `model.quantization`): bitsandbytes settings and checks.

transformers' `BitsAndBytesConfig` quantizes the base's linear layers as
`pipeline.model.loading.load_base` reads them, on a GPU or on the CPU
(bitsandbytes 0.49+ runs its 4-bit and 8-bit layers there, forward and
backward). This module says how (`quantization_config`), what to fix after
the load on a CPU (`one_cpu_kernel`, `off_the_file`), and what is refused, at
plan time, naming the keys (`check_quantization`; a quantized base sharded by FSDP:
`pipeline.planning.checks.refuse_quantized_sharded`).
"""

from __future__ import annotations

import torch

from pipeline.config import ModelConfig, TrainConfig
from pipeline.errors import UserError
from pipeline.storage import dtypes

QUANT_EXTRA = 'pip install -e ".[quant]"'


def described(model: ModelConfig) -> str:
    """The words error messages about the base add: ' with model.quantization=nf4' (none for a float base)."""
    return "" if model.quantization == "none" else f" with model.quantization={model.quantization}"


def quantization_config(model: ModelConfig, compute_dtype: torch.dtype):
    """transformers' `BitsAndBytesConfig` for `model.quantization` (None: a float base).

    nf4 / fp4 store 4 bits per weight in blocks of 64 with one absmax per
    block (`model.quant_double`: those quantized to 8 bits too) and multiply in
    `model.quant_compute_dtype` (auto: `compute_dtype`); int8 is LLM.int8()
    (row-wise int8, outlier columns in fp16). The output head is left in float
    by transformers, and a layer whose weight the family's forward reads itself
    (Mamba's `dt_proj`) by us. UserError when bitsandbytes is not installed.
    """
    kind = model.quantization
    if kind == "none":
        return None
    require_bitsandbytes(model)
    from transformers import BitsAndBytesConfig

    skip = {"llm_int8_skip_modules": ["lm_head", *read]} if (read := _read_past_layer(model)) else {}
    if kind == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, **skip)
    compute = compute_dtype if model.quant_compute_dtype == "auto" else dtypes.BY_NAME[model.quant_compute_dtype]
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=str(kind), bnb_4bit_compute_dtype=compute,
                              bnb_4bit_use_double_quant=model.quant_double, **skip)


def _read_past_layer(model: ModelConfig) -> tuple[str, ...]:
    """The Linear layers of the base whose weight its family's forward reads itself
    (`pipeline.compat.WEIGHT_READ_PAST_LAYER`: Mamba's `dt_proj`), left in float. Naming them
    to bitsandbytes replaces transformers' own list (the output head, for these families `lm_head`),
    so that goes too."""
    from transformers import AutoConfig

    from pipeline.compat import WEIGHT_READ_PAST_LAYER

    config = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    return WEIGHT_READ_PAST_LAYER.get(getattr(config, "model_type", None), ())


def stored_method(config) -> str | None:
    """The quantization method a base is stored in (its config.json `quantization_config.quant_method`:
    "mxfp4", "fp8", "gptq", "bitsandbytes", ...), or None for a float base."""
    stored = getattr(config, "quantization_config", None)
    if not stored:
        return None
    return str(stored.get("quant_method", "?") if isinstance(stored, dict) else getattr(stored, "quant_method", "?"))


def stored_config(config, path):
    """transformers' quantization config for loading a base stored quantized as numbers, or None (a float base).

    MXFP4 (GPT-OSS as OpenAI publishes it) and block-scaled FP8 with dynamic activations (DeepSeek-V3's own
    release, the FP8 releases of Qwen3, GLM, MiniMax): `Mxfp4Config` / `FineGrainedFP8Config` with
    `dequantize=True`, the weights dequantized as they load, where they are trained on (LoRA beside them) and
    merged (`pipeline.storage.packed`). Without it a machine with transformers' kernels for the method keeps
    the weights quantized (untrainable), and a `quantization_config=None` (a float base's) loads MXFP4's
    packed experts not at all (initialised at random) and FP8's codes without their scales. Any other stored
    method (GPTQ, AWQ, FP8 with static activation scales, a saved bitsandbytes model) is a UserError: its
    weights are codes the merge cannot add to."""
    method = stored_method(config)
    if method is None:
        return None
    from pipeline.storage import packed

    stored = config.quantization_config
    stored = stored if isinstance(stored, dict) else stored.to_dict()
    kind = packed.method({"quantization_config": stored})
    if kind == "mxfp4":
        from transformers import Mxfp4Config

        return Mxfp4Config(dequantize=True)
    if kind == "fp8":
        from transformers import FineGrainedFP8Config

        return FineGrainedFP8Config(dequantize=True, weight_block_size=tuple(stored.get("weight_block_size")
                                                                             or packed.FP8_BLOCK))
    raise UserError(f"the base {path} is stored quantized (config.json quantization_config, quant_method={method}): "
                    "its weights are codes, which training here does not dequantize and the merge cannot add the "
                    "adapter to; use the model's unquantized (bf16) release. Read as numbers: MXFP4 (GPT-OSS as "
                    "published) and block FP8 with dynamic activation scales")


def require_bitsandbytes(model: ModelConfig) -> None:
    """UserError naming the setting and the extra when a quantized base is asked for without bitsandbytes."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError(f"model.quantization={model.quantization} needs bitsandbytes, which is not installed: "
                        f"{QUANT_EXTRA} (or set model.quantization=none)")


def count_quantized(model) -> int:
    """The bitsandbytes layers (4-bit or 8-bit) of a loaded model: what its log line reports."""
    import bitsandbytes as bnb

    return sum(isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)) for m in model.modules())


@torch.no_grad()
def off_the_file(model) -> None:
    """Give the float tensors of a quantized base on the CPU memory of their own.

    transformers leaves a tensor read in its stored dtype as a view of the
    memory-mapped safetensors file, which keeps the whole mapping alive; every
    page of it read while the linear layers were quantized (all of their float
    weights) then stays resident in the process, and a 4-bit base would hold
    its float weights in host memory after all. Copying the few float tensors
    left (embeddings, norms, the head) lets the mapping close.
    """
    done = set()
    for module in model.modules():
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            if tensor is not None and id(tensor) not in done and tensor.is_floating_point() and tensor.device.type == "cpu":
                tensor.data = tensor.data.clone()  # (a tied head is the embedding's parameter: copied once)
                done.add(id(tensor))


def one_cpu_kernel(model) -> None:
    """Keep bitsandbytes' 4-bit layers on one kernel on a CPU, in training and evaluation alike.

    On a CPU with AVX512-BF16, a `Linear4bit` that runs in eval mode without
    gradients repacks its weight in place, for good, into the layout of an
    inference-only kernel: one without a backward (a later training forward
    would give no gradient through the layer) and whose layout needs
    in_features to be a multiple of 64. A stage that evaluated would then
    train on another kernel than one that did not, and a chunked run would no
    longer be bitwise the uninterrupted one. GPUs are not concerned (the switch
    is read on a CPU only).
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def check_quantization(model: ModelConfig) -> None:
    """At plan time: UserError, naming the keys, when bitsandbytes cannot load this base quantized, or the
    base is stored quantized in a method that is not read as numbers (`stored_config`).

    bitsandbytes must be installed, and the base must be stored unquantized:
    a checkpoint that is quantized already (its config.json has a
    `quantization_config`: GPTQ, AWQ, FP8, MXFP4, a saved bitsandbytes model) has no
    float weights for the merge to add the adapter to.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    if model.quantization == "none":
        stored_config(config, model.path)  # a base stored in a method that cannot be read as numbers
        return
    require_bitsandbytes(model)
    if method := stored_method(config):
        raise UserError(f"model.quantization={model.quantization}: the base {model.path} is stored quantized "
                        f"already (config.json quantization_config, quant_method={method}); QLoRA here quantizes an "
                        "unquantized base as it loads, and the merge adds the adapter to its float weights: "
                        "use the unquantized model (model in config/config.yaml)")
