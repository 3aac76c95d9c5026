"""The parts of a vision-language model, and which of them are trained.

An image-text-to-text model has three parts: the vision tower (encoder), the
projector that maps its features into the language model's embedding space,
and the language model. Transformers names them per family (LLaVA:
`model.vision_tower`, `model.multi_modal_projector`, `model.language_model`;
Qwen2-VL: `model.visual`, `model.visual.merger`, `model.language_model`; Gemma 4's
projector is `model.embed_vision`);
`find_parts` finds the shallowest module under each known name (Granite 4 Vision's projector is
several modules at that depth: `layerwise_projectors`, `spatial_projectors`; DeepSeek-VL hybrid's
tower has its SAM path on a high-resolution view beside it, `more_towers`).

What is trained (`vision` config group, `lora` group for the language model):

    language model   LoRA adapters on lora.target_modules (or every weight in full FT)
    projector        frozen; vision.train_projector: in full (under LoRA as PEFT modules_to_save,
                     so the adapter dir holds it and stock peft loads it)
    vision tower     frozen; vision.train_tower: adapters on the same target names inside it
                     (LoRA) or every weight (full FT)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipeline.errors import UserError

# Module names of each part across families, most common first.
TOWER_NAMES = ("vision_tower", "visual", "vision_model", "vision_encoder")
PROJECTOR_NAMES = ("multi_modal_projector", "merger", "mm_projector", "connector", "embed_vision", "patch_merger",
                   "vision_projection", "projector", "visual_embeddings_table", "layerwise_projectors",
                   "spatial_projectors", "aligner")
# A second view's encoder beside the tower, under the tower's parent, modules or a bare parameter: DeepSeek-VL
# hybrid's SAM path on a high-resolution copy of the image (its encoder, neck, projection and their mixing weight)
MORE_TOWER_NAMES = ("high_res_vision_model", "high_res_vision_neck", "high_res_vision_proj", "high_res_vision_alpha")
LANGUAGE_NAMES = ("language_model", "text_model")


@dataclass(frozen=True)
class VisionParts:
    """Qualified module names of the three parts (as `model.named_modules()` gives them). A projector made of
    several modules side by side (Granite 4 Vision's deepstack and spatial Q-Formers) is `projector` and
    `more_projectors`; a second view's encoder beside the tower (DeepSeek-VL hybrid's SAM path) is
    `more_towers`, modules or a bare parameter."""

    language: str
    tower: str
    projector: str
    more_projectors: tuple[str, ...] = ()
    more_towers: tuple[str, ...] = ()

    @property
    def projectors(self) -> tuple[str, ...]:
        return (self.projector, *self.more_projectors)

    @property
    def towers(self) -> tuple[str, ...]:
        return (self.tower, *self.more_towers)


def find_parts(model) -> VisionParts:
    """The three parts of an (unwrapped) vision-language model; `UserError` naming what is missing.

    The projector is the one module beside the tower and the language model, under their common parent, that
    holds weights, where a known name finds none (ERNIE 4.5 VL's `resampler_model`) or finds only the tower's own
    merger (HyperCLOVA X Vision v2's `projector` follows its Qwen2.5-VL tower's `merger`)."""
    found = {}
    for part, names in (("language", LANGUAGE_NAMES), ("tower", TOWER_NAMES), ("projector", PROJECTOR_NAMES)):
        matches = [n for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] in names]
        if part == "projector" and all(n.startswith(found["tower"] + ".") for n in matches):
            matches = _sole_sibling(model, found["tower"], found["language"]) or matches
        if not matches:
            raise UserError(f"cannot find the {part} of {type(model).__name__} (a module named one of {names})")
        depth = min(n.count(".") for n in matches)
        found[part], *more = [n for n in matches if n.count(".") == depth]
        if part == "projector":
            found["more_projectors"] = tuple(more)
        if part == "tower":
            found["more_towers"] = _beside(model, found["tower"], MORE_TOWER_NAMES)
    return VisionParts(**found)


def _beside(model, tower: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """The qualified names of the tower's parent's own modules and parameters named one of `names`."""
    parent = tower.rpartition(".")[0]
    module = model.get_submodule(parent)
    own = [n for n, _ in module.named_children()] + [n for n, _ in module.named_parameters(recurse=False)]
    return tuple(f"{parent}.{n}" if parent else n for n in own if n in names)


def _sole_sibling(model, tower: str, language: str) -> list[str]:
    """[the name of the one weight-holding child of the tower's parent, other than the tower and the language
    model], or [] where the parent is not the language model's too or there is not exactly one such child."""
    parent = tower.rpartition(".")[0]
    if language.rpartition(".")[0] != parent:
        return []
    children = [f"{parent}.{n}" if parent else n for n, child in model.get_submodule(parent).named_children()
                if next(child.parameters(), None) is not None]
    others = [n for n in children if n not in (tower, language)]
    return others if len(others) == 1 else []


def in_lora_scope(parts: VisionParts, name: str, *, tower: bool) -> bool:
    """Is module `name` one LoRA may adapt: inside the language model (or, with `tower`, the vision
    tower), never inside the projector (which trains in full or not at all)?"""
    if name.startswith(tuple(p + "." for p in parts.projectors)):
        return False
    return name.startswith(parts.language + ".") or (tower and name.startswith(tuple(t + "." for t in parts.towers)))


def lora_targets(parts: VisionParts, target_modules: list[str], *, tower: bool) -> str:
    """PEFT `target_modules` as a regex: the target names inside the language model (and the tower),
    none inside the projector (`in_lora_scope`).

    A plain list would match the same names in the vision tower too (CLIP has
    q_proj, k_proj, v_proj); PEFT full-matches a string against module names.
    """
    scopes = [parts.language] + (list(parts.towers) if tower else [])
    return (rf"(?!(?:{'|'.join(map(re.escape, parts.projectors))})\.)(?:{'|'.join(map(re.escape, scopes))})\..*\."
            rf"(?:{'|'.join(map(re.escape, target_modules))})")


def matching_modules(model, regex: str) -> list[str]:
    """The names of `model`'s modules that `regex` (a `lora_targets` pattern) matches as peft matches it (in
    full): the same targets as a list, which peft's conversion of fused-expert families leaves as they are."""
    pattern = re.compile(regex)
    return [n for n, _ in model.named_modules() if pattern.fullmatch(n)]


def scoped_parameters(model, parts: VisionParts, names: list[str], *, tower: bool) -> list[str]:
    """peft `target_parameters` that adapt nothing outside the LoRA scope (`in_lora_scope`).

    peft adapts every parameter whose name ends with one of `names`. A name
    that also ends parameters outside the scope (GLM-4.5V's dense MLP adapted
    through `gate_proj.weight`, which its tower's MLP and its projector also
    have) is replaced by the full names of its parameters in scope.
    """
    params = [n for n, _ in model.named_parameters()]
    out = []
    for name in names:
        matched = [n for n in params if n == name or n.endswith("." + name)]
        inside = [n for n in matched if in_lora_scope(parts, n.rsplit(".", 1)[0], tower=tower)]
        out += [name] if inside == matched else inside
    return out


def freeze_for_full_finetuning(model, parts: VisionParts, *, train_projector: bool, train_tower: bool) -> None:
    """Full fine-tuning: everything trains but the tower (with any second view's encoder beside it) and
    projector, unless asked (tower first: a projector may live inside it, Qwen2-VL's merger does)."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    model.requires_grad_(True)
    for tower in parts.towers:
        (modules[tower] if tower in modules else params[tower]).requires_grad_(train_tower)
    for projector in parts.projectors:
        modules[projector].requires_grad_(train_projector)
