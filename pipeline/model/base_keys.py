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

Some bases store a Linear weight not under a name of its own but as rows of a
larger tensor (Sarvam-MoE: `q_proj`, `k_proj`, `v_proj` are the rows of one
`query_key_value`; LaraMini: four input projections in one `in_proj`), or with
its rows reordered (Mistral Large 3's rotary permutation of `wq` / `wk`).
`BaseKeys.rows` says where each row of such a weight is stored, asked of
Transformers' own reverse conversion: the live weights of the weight's parent
module, each row holding its own number (a column of them, not the whole
matrix), go through `revert_weight_conversion`, and the numbers come out where
`save_pretrained` would write those rows.
"""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class StoredRows:
    """Rows `live[i]` of a live weight are rows `stored[i]` of the base's tensor `key`."""

    key: str
    live: tuple[int, ...]
    stored: tuple[int, ...]


class BaseKeys:
    """live parameter name -> the key `base` stores it under (`stored` are the base's keys)."""

    def __init__(self, base: Path, stored: set[str]):
        self.base, self.stored = Path(base), set(stored)
        self._renamed: dict[str, str] | None = None
        self._model = None
        self._rows: dict[str, dict[str, tuple[StoredRows, ...]]] = {}

    def __call__(self, name: str) -> str:
        if name in self.stored:
            return name
        if self._renamed is None:
            self._renamed = self._saved_names()
        return self._renamed.get(name, name)

    def _saved_names(self) -> dict[str, str]:
        """Each parameter's name as `save_pretrained` writes it (reverting the load-time renamings)."""
        from transformers.core_model_loading import revert_weight_conversion

        model = self._meta()
        # One distinct placeholder per name, of its shape (a fused expert weight's conversion cuts it
        # along its dims): the reverted dict is matched back by identity, so a weight transformers
        # stores as several tensors (experts: `pipeline.model.expert_keys`) maps to none of them.
        placeholders = {name: torch.empty(p.shape, device="meta")
                        for name, p in model.named_parameters(remove_duplicate=False)}
        reverted = revert_weight_conversion(model, dict(placeholders))
        by_id = {id(t): key for key, t in reverted.items()}
        return {name: by_id[id(t)] for name, t in placeholders.items() if id(t) in by_id}

    def _meta(self):
        if self._model is None:
            self._model = _meta_model(self.base)
        return self._model

    def rows(self, name: str) -> tuple[StoredRows, ...] | None:
        """Where the rows of the live weight `name` are stored, when the base stores it as rows of other
        tensors (module docstring); None when it does not, or not as whole rows (a transposed weight)."""
        parent = name.rsplit(".", 2)[0]
        if parent not in self._rows:
            self._rows[parent] = self._row_layout(parent)
        return self._rows[parent].get(name)

    def _row_layout(self, parent: str) -> dict[str, tuple[StoredRows, ...]]:
        from transformers.core_model_loading import revert_weight_conversion

        params = {n: p for n, p in self._meta().named_parameters() if n.startswith(parent + ".") and p.ndim == 2}
        spans, numbered, start = {}, {}, 0
        for n, p in params.items():  # float64 numbers are exact far beyond any row count
            numbered[n] = torch.arange(start, start + p.shape[0], dtype=torch.float64).unsqueeze(1)
            spans[n] = (start, start + p.shape[0])
            start += p.shape[0]
        reverted = revert_weight_conversion(self._meta(), dict(numbered))
        # each stored tensor made of whole rows: its rows' numbers, in order
        columns = {k: t.reshape(-1).tolist() for k, t in reverted.items()
                   if k in self.stored and t.ndim >= 1 and all(d == 1 for d in t.shape[1:])}
        out = {}
        for n, (lo, hi) in spans.items():
            if n in self.stored or self(n) in self.stored:
                continue
            parts = []
            for key, numbers in columns.items():
                hits = [(int(v) - lo, i) for i, v in enumerate(numbers) if lo <= v < hi]
                if hits:
                    parts.append(StoredRows(key, tuple(h[0] for h in hits), tuple(h[1] for h in hits)))
            live = sorted(r for part in parts for r in part.live)
            if live == list(range(hi - lo)):  # every row stored once: a layout the merge can follow
                out[n] = tuple(parts)
        return out


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
