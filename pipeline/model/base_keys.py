"""The key a base model dir stores each parameter under, and the weights it ties.

Adapters and full fine-tuning checkpoints name tensors as the live model does
(`model.language_model.layers.0...` in a Transformers 5 LLaVA). The files of a
base need not: Transformers 5 moved the modules of several vision-language
families but keeps their checkpoints in the old layout (LLaVA:
`language_model.model.layers.0...`, Qwen2-VL: `model.layers.0...`, `visual.*`),
renaming keys on load and back on save (`conversion_mapping`). `BaseKeys` maps
a live name to the stored one the same way `save_pretrained` does, so the merge
and the consolidation write the layout the base has, and stock
`from_pretrained` reads them back; FSDP's sharded load
(`pipeline.train.sharded_load`) reads each rank's rows under the same keys. A
name the base stores as it is needs no model at all (every text model here);
otherwise the model is built once on the meta device (nothing allocated) to ask
Transformers for its renamings.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.errors import UserError


def _meta_model(base: Path):
    """The base's architecture on the meta device."""
    from transformers import AutoConfig

    from pipeline.model.base import auto_class

    try:
        config = AutoConfig.from_pretrained(base)
        with torch.device("meta"):
            return auto_class(config).from_config(config)
    except Exception as err:  # unknown / remote-code architectures
        raise UserError(f"cannot build the --base architecture {base} to read its key layout: {err}") from None


class BaseKeys:
    """live parameter name -> the key `base` stores it under (`stored` are the base's keys)."""

    def __init__(self, base: Path, stored: set[str]):
        self.base, self.stored = Path(base), set(stored)
        self._renamed: dict[str, str] | None = None

    def __call__(self, name: str) -> str:
        if name in self.stored:
            return name
        if self._renamed is None:
            self._renamed = self._saved_names()
        return self._renamed.get(name, name)

    def _saved_names(self) -> dict[str, str]:
        """Each parameter's name as `save_pretrained` writes it (reverting the load-time renamings)."""
        from transformers.core_model_loading import revert_weight_conversion

        model = _meta_model(self.base)
        # One distinct placeholder per name, of its shape (a fused expert weight's conversion cuts it
        # along its dims): the reverted dict is matched back by identity, so a weight transformers
        # stores as several tensors (experts: `pipeline.model.expert_keys`) maps to none of them.
        placeholders = {name: torch.empty(p.shape, device="meta")
                        for name, p in model.named_parameters(remove_duplicate=False)}
        reverted = revert_weight_conversion(model, dict(placeholders))
        by_id = {id(t): key for key, t in reverted.items()}
        return {name: by_id[id(t)] for name, t in placeholders.items() if id(t) in by_id}


def tied_aliases(base: Path, keys: BaseKeys) -> set[str]:
    """Parameter names the base does not store because they share storage with one it does
    (e.g. lm_head.weight tied to the embeddings). The model class itself says which weights
    it ties (built on the meta device)."""
    model = _meta_model(base)
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    aliases = set()
    for names in groups.values():
        stored = [n for n in names if keys(n) in keys.stored]
        if stored:
            aliases.update(n for n in names if keys(n) not in keys.stored)
    return aliases
