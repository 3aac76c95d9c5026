"""Bases stored in MXFP4 (GPT-OSS as OpenAI publishes it): their packed expert weights read as numbers.

A checkpoint whose config.json has `quantization_config.quant_method == "mxfp4"` stores each fused
expert weight `<name>` (live shape (experts, in, out)) as two tensors: `<name>_blocks`, uint8
(experts, out, in / 32, 16), two 4-bit e2m1 codes per byte (the low nibble first), and `<name>_scales`,
uint8 (experts, out, in / 32), one power-of-two exponent per block of 32 codes, biased by 127.
transformers dequantizes them on load where it has no MXFP4 kernels (and, asked with
`Mxfp4Config(dequantize=True)`, everywhere): the stages train on those numbers, LoRA beside them.

The merge cannot add a delta to codes, so it reads such a base through `Packed`: the pairs as one
logical tensor each, dequantized as transformers does it (exactly: every e2m1 value times a power of
two is a bf16 number), in the dtype of the base's other float tensors, written as a plain tensor of the
merged model, whose config then has no `quantization_config` (`hf_dir.set_config_unquantized`). A full
fine-tuning's export and the FSDP skeleton's load read it the same way.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.errors import UserError
from pipeline.storage import dtypes
from pipeline.storage.hf_dir import WeightFiles, find_weights, read_config
from pipeline.storage.safetensors_stream import TensorSpec, read_tensor

BLOCKS, SCALES = "_blocks", "_scales"
CODES_PER_BLOCK = 32
# e2m1: sign, 2 exponent bits, 1 mantissa bit; the code is the index
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
DTYPE = torch.bfloat16  # GPT-OSS's dtype: the experts' where no other float tensor says otherwise


def is_mxfp4(config: dict) -> bool:
    """Does this config.json (as a dict) describe an MXFP4 checkpoint?"""
    quant = config.get("quantization_config") or {}
    return isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    """The live weight (experts, in, out) of a packed pair: blocks (experts, out, groups, 16) uint8, scales
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


class Packed:
    """The weights of an MXFP4 base as numbers: each `<name>_blocks` / `<name>_scales` pair is one tensor
    `<name>` (the live shape, in the dtype of the base's other float tensors, as transformers loads them into
    a model of that dtype: GPT-OSS's bf16) in the shard that holds its blocks; every other tensor as stored."""

    def __init__(self, root: Path, specs: dict[str, list[TensorSpec]]):
        """`specs`: the base's shard file -> its tensors (`hf_dir.WeightFiles.specs`)."""
        self.root = root
        where = {spec.name: file for file, listed in specs.items() for spec in listed}
        stored = {spec.name: spec for listed in specs.values() for spec in listed}
        self.dtype = dtypes.dominant_float((spec.dtype, spec.numel) for spec in stored.values()) or DTYPE
        self.pairs: dict[str, tuple[str, str]] = {}  # logical name -> (file of its blocks, file of its scales)
        self.specs: dict[str, list[TensorSpec]] = {}
        for file, listed in specs.items():
            self.specs[file] = []
            for spec in listed:
                if spec.name.endswith(SCALES) and spec.name[:-len(SCALES)] + BLOCKS in stored:
                    continue
                name = spec.name[:-len(BLOCKS)]
                if spec.name.endswith(BLOCKS) and name + SCALES in stored:
                    experts, out, groups, _ = spec.shape
                    self.pairs[name] = (file, where[name + SCALES])
                    self.specs[file].append(TensorSpec(name, self.dtype, (experts, groups * CODES_PER_BLOCK, out)))
                else:
                    self.specs[file].append(spec)
        if not self.pairs:
            raise UserError(f"{root}: its config says MXFP4, but no tensor has a {BLOCKS} / {SCALES} pair")

    @property
    def all_specs(self) -> dict[str, TensorSpec]:
        return {spec.name: spec for listed in self.specs.values() for spec in listed}

    def read(self, file: str, name: str) -> torch.Tensor:
        """Tensor `name` of shard `file`: dequantized where it is a packed pair."""
        if name not in self.pairs:
            return read_tensor(self.root / file, name)
        return self.experts(name, 0, None)

    def experts(self, name: str, start: int, stop: int | None) -> torch.Tensor:
        """Experts `start:stop` (dim 0) of the packed pair `name`, dequantized: an FSDP rank's rows of it."""
        from safetensors import safe_open

        parts = []
        for file, suffix in zip(self.pairs[name], (BLOCKS, SCALES)):
            with safe_open(str(self.root / file), framework="pt") as handle:
                parts.append(handle.get_slice(name + suffix)[start:stop])
        return dequantize(*parts, dtype=self.dtype)


def in_dtype(model, packed: Packed, dtype: torch.dtype) -> None:
    """Cast the parameters of `model` (loaded from the MXFP4 base `packed` reads) dequantized from its pairs to
    `dtype`. transformers 5.17 dequantizes them into bf16 whatever dtype the model loads in (5.24 into that
    dtype): in an fp32 run they would compute in bf16, not as the run and the merge do."""
    params = dict(model.named_parameters())
    for name in packed.pairs:
        param = params.get(name)
        if param is not None and param.dtype != dtype:
            param.data = param.data.to(dtype)


def packed_weights(root: Path | str, label: str = "the base") -> Packed:
    """`Packed` over the weight files of the MXFP4 model dir `root`."""
    weights = find_weights(root, label)
    return Packed(weights.root, weights.specs)


def packed_if_mxfp4(weights: WeightFiles) -> Packed | None:
    """`Packed` over `weights` where its model dir's config.json says MXFP4, else None (read as stored)."""
    return Packed(weights.root, weights.specs) if is_mxfp4(read_config(weights.root)) else None
