"""Bases whose files store some weights quantized, read as numbers: MXFP4 (GPT-OSS as OpenAI publishes it)
and block-scaled FP8 (DeepSeek-V3's own release, the FP8 releases of Qwen3, GLM, MiniMax).

MXFP4 (config.json `quantization_config.quant_method == "mxfp4"`) stores each fused expert weight `<name>`
(live shape (experts, in, out)) as two tensors: `<name>_blocks`, uint8 (experts, out, in / 32, 16), two 4-bit
e2m1 codes per byte (the low nibble first), and `<name>_scales`, uint8 (experts, out, in / 32), one
power-of-two exponent per block of 32 codes, biased by 127.

FP8 (`quant_method == "fp8"`, `activation_scheme: dynamic`) stores a Linear weight `<name>` (out, in) as
float8 e4m3 codes under its own name and `<name>_scale_inv`, float32 (ceil(out / bo), ceil(in / bi)), one
factor per block of `weight_block_size` [bo, bi] (default 128 x 128): weight = codes x factor.

transformers dequantizes both on load where it has no kernels for them (and, asked with
`Mxfp4Config(dequantize=True)` / `FineGrainedFP8Config(dequantize=True)`, everywhere): the stages train on
those numbers, LoRA beside them (`pipeline.model.quantization.stored_config`). The merge cannot add a delta to
codes, so it reads such a base through `Packed`: each pair as one tensor of numbers, dequantized as
transformers does it, in the dtype of the base's other float tensors, written as a plain tensor of the merged
model, whose config then has no `quantization_config` (`hf_dir.set_config_unquantized`). A full fine-tuning's
export and the FSDP skeleton's load read it the same way.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.errors import UserError
from pipeline.storage import dtypes
from pipeline.storage.hf_dir import WeightFiles, find_weights, read_config
from pipeline.storage.safetensors_stream import TensorSpec, read_tensor

BLOCKS, SCALES = "_blocks", "_scales"  # MXFP4's pair: <name>_blocks, <name>_scales
SCALE_INV = "_scale_inv"  # FP8's pair: <name>, <name>_scale_inv
CODES_PER_BLOCK = 32
# e2m1: sign, 2 exponent bits, 1 mantissa bit; the code is the index
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
DTYPE = torch.bfloat16  # the releases' dtype: the numbers' where no other float tensor says otherwise
FP8_BLOCK = (128, 128)
FP8_CODES = (torch.float8_e4m3fn,)


def method(config: dict) -> str | None:
    """The stored method `Packed` reads as numbers that this config.json (as a dict) names ("mxfp4", "fp8"),
    or None (a float base, or a method read otherwise)."""
    quant = config.get("quantization_config") or {}
    if not isinstance(quant, dict):
        return None
    if quant.get("quant_method") == "mxfp4":
        return "mxfp4"
    if quant.get("quant_method") == "fp8" and quant.get("activation_scheme", "dynamic") == "dynamic":
        return "fp8"
    return None


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    """The live weight (experts, in, out) of an MXFP4 pair: blocks (experts, out, groups, 16) uint8, scales
    (experts, out, groups) uint8."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.ndim != 4 \
            or tuple(blocks.shape[:3]) != tuple(scales.shape) or blocks.shape[3] * 2 != CODES_PER_BLOCK:
        raise UserError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                        f"{scales.dtype} are not a packed pair (uint8 (E, out, groups, 16) and (E, out, groups))")
    table = torch.tensor(E2M1, dtype=torch.float32)
    experts, out, groups, _ = blocks.shape
    weight = torch.empty(experts, groups * CODES_PER_BLOCK, out, dtype=dtype)
    for expert in range(experts):  # one expert's codes at a time: GPT-OSS-120b's whole gate_up_proj is 2.1G codes
        codes = torch.stack((blocks[expert] & 0x0F, blocks[expert] >> 4), dim=-1).flatten(-2)  # low nibble first
        values = torch.ldexp(table[codes.int()], (scales[expert].to(torch.int32) - 127).unsqueeze(-1))
        weight[expert] = values.reshape(out, groups * CODES_PER_BLOCK).T
    return weight


def dequantize_fp8(codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], first_row: int = 0,
                   dtype: torch.dtype = DTYPE) -> torch.Tensor:
    """The weight of an FP8 pair: codes (rows, in) float8, rows `first_row`.. of the whole weight; scale_inv
    float32, one factor per block (`block`: rows x columns) of the whole weight, or one for all of it."""
    if codes.dtype not in FP8_CODES or codes.ndim != 2:
        raise UserError(f"FP8 codes {tuple(codes.shape)} {codes.dtype} are not a float8 e4m3 matrix")
    if scale_inv.numel() == 1:
        return (codes.to(torch.float32) * scale_inv.to(torch.float32).reshape(())).to(dtype)
    rows = torch.arange(first_row, first_row + codes.shape[0]) // block[0]
    columns = torch.arange(codes.shape[1]) // block[1]
    if scale_inv.ndim != 2 or (codes.shape[0] and int(rows[-1]) >= scale_inv.shape[0]) \
            or (codes.shape[1] and int(columns[-1]) >= scale_inv.shape[1]):
        raise UserError(f"FP8 scales {tuple(scale_inv.shape)} do not cover a weight of {codes.shape[1]} columns in "
                        f"blocks of {list(block)}")
    factors = scale_inv.to(torch.float32)[rows][:, columns]
    return (codes.to(torch.float32) * factors).to(dtype)


class Packed:
    """The weights of a base stored in MXFP4 or FP8 (`method`) as numbers: each pair is one tensor (the live
    shape, in the dtype of the base's other float tensors, as transformers loads them into a model of that
    dtype: the releases' bf16) in the shard that holds its codes; every other tensor as stored."""

    def __init__(self, root: Path, specs: dict[str, list[TensorSpec]], kind: str, block: tuple[int, int] = FP8_BLOCK):
        """`specs`: the base's shard file -> its tensors (`hf_dir.WeightFiles.specs`); `kind`: "mxfp4" or
        "fp8"; `block`: FP8's `weight_block_size`."""
        self.root, self.kind, self.block = root, kind, tuple(block)
        where = {spec.name: file for file, listed in specs.items() for spec in listed}
        stored = {spec.name: spec for listed in specs.values() for spec in listed}
        self.dtype = dtypes.dominant_float((spec.dtype, spec.numel) for spec in stored.values()
                                           if spec.dtype not in FP8_CODES) or DTYPE
        codes_suffix, scales_suffix = (BLOCKS, SCALES) if kind == "mxfp4" else ("", SCALE_INV)
        self.pairs: dict[str, tuple[str, str]] = {}  # name of the numbers -> (file of its codes, of its scales)
        self.specs: dict[str, list[TensorSpec]] = {}
        for file, listed in specs.items():
            self.specs[file] = []
            for spec in listed:
                name = spec.name[:len(spec.name) - len(codes_suffix)]
                if spec.name.endswith(scales_suffix) and spec.name[:-len(scales_suffix)] + codes_suffix in stored:
                    continue  # a pair's scales: read with its codes
                if spec.name.endswith(codes_suffix) and name + scales_suffix in stored:
                    self.pairs[name] = (file, where[name + scales_suffix])
                    self.specs[file].append(TensorSpec(name, self.dtype, self._shape(spec)))
                else:
                    self.specs[file].append(spec)
        if not self.pairs:
            raise UserError(f"{root}: its config says {kind}, but no tensor has its {codes_suffix or '<name>'} / "
                            f"{scales_suffix} pair")

    def _shape(self, codes: TensorSpec) -> tuple[int, ...]:
        if self.kind == "mxfp4":
            experts, out, groups, _ = codes.shape
            return experts, groups * CODES_PER_BLOCK, out
        return tuple(codes.shape)

    @property
    def all_specs(self) -> dict[str, TensorSpec]:
        return {spec.name: spec for listed in self.specs.values() for spec in listed}

    def read(self, file: str, name: str) -> torch.Tensor:
        """Tensor `name` of shard `file`: dequantized where it is a pair."""
        if name not in self.pairs:
            return read_tensor(self.root / file, name)
        return self.rows(name, 0, None)

    def rows(self, name: str, start: int, stop: int | None) -> torch.Tensor:
        """Rows (dim 0: MXFP4's experts, FP8's output features) `start:stop` of the pair `name`, dequantized:
        an FSDP rank's rows of it."""
        from safetensors import safe_open

        codes_file, scales_file = self.pairs[name]
        if self.kind == "mxfp4":
            parts = []
            for file, suffix in ((codes_file, BLOCKS), (scales_file, SCALES)):
                with safe_open(str(self.root / file), framework="pt") as handle:
                    parts.append(handle.get_slice(name + suffix)[start:stop])
            return dequantize(*parts, dtype=self.dtype)
        with safe_open(str(self.root / codes_file), framework="pt") as handle:
            codes = handle.get_slice(name)[start:stop]
        return dequantize_fp8(codes, read_tensor(self.root / scales_file, name + SCALE_INV), self.block, start,
                              self.dtype)


def in_dtype(model, packed: Packed, dtype: torch.dtype) -> None:
    """Cast the parameters of `model` (loaded from the base `packed` reads) dequantized from its pairs to
    `dtype`. transformers 5.17 dequantizes MXFP4 into bf16 whatever dtype the model loads in (5.24 into that
    dtype): in an fp32 run they would compute in bf16, not as the run and the merge do."""
    params = dict(model.named_parameters())
    for name in packed.pairs:
        param = params.get(name)
        if param is not None and param.dtype != dtype:
            param.data = param.data.to(dtype)


def packed_if_stored(weights: WeightFiles) -> Packed | None:
    """`Packed` over `weights` where its model dir's config.json names a method it reads (`method`), else None
    (read as stored)."""
    config = read_config(weights.root)
    kind = method(config)
    if kind is None:
        return None
    block = (config["quantization_config"].get("weight_block_size") or FP8_BLOCK) if kind == "fp8" else FP8_BLOCK
    return Packed(weights.root, weights.specs, kind, tuple(block))


def packed_weights(root: Path | str, label: str = "the base") -> Packed:
    """`Packed` over the weight files of the model dir `root`, stored in a method `method` names."""
    found = packed_if_stored(find_weights(root, label))
    if found is None:
        raise UserError(f"{label} {root}: its config.json names no stored method read as numbers (mxfp4, fp8)")
    return found
