"""The attention kernel a model runs with: `model.attn_implementation`, resolved.

    impl, reason = resolve(requested, support_of(model_class, family), Machine.here(device))
    # pipeline.model.base.attention_choice(requested, config, device) does exactly this for a config

`resolve` is a pure function of three small facts, so the plan (which prints
the choice), every training stage and evaluation (which load the model with
it) and the packing decision (`tokens.packing=auto` packs under flash
attention, whose varlen kernel keeps packed sequences apart) all decide alike:

* `requested`: the setting, `auto` or one of `pipeline.config.Attention`;
* `Support`: what the model's class says it supports (transformers' class
  flags `_supports_sdpa`, `_supports_flash_attn`, `_supports_flex_attn`, and
  `_compatible_flash_implementations`, the only flash builds a family works
  with: GPT-OSS lists kernels-hub builds that implement its attention sinks);
* `Machine`: a CUDA device or not, and whether the flash-attn package is installed.

A model whose head size (in any layer: Gemma 4's full-attention layers have heads of 512) is over
the 256 flash-attn's kernels take does not run on them, whatever its class says (`head_sizes`).

`auto` takes the best the model supports and the machine has:
flash_attention_2 (CUDA, flash-attn installed, a family that runs on the
package's kernels), else SDPA where the family supports it, else eager (GPT-OSS
everywhere: SDPA cannot express its sinks, and its flash builds come from the
kernels hub, which `auto` does not download). An explicit value the family does
not support is a UserError naming `model.attn_implementation` and the values it
supports; whether an installed package or a GPU backs an explicit flash choice
is for transformers to say when the model loads (`pipeline.model.base`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from pipeline.compat import per_layer
from pipeline.config import Attention
from pipeline.errors import UserError

AUTO = Attention.auto.value
FLASH = ("flash_attention_2", "flash_attention_3")
FLASH_HEAD_LIMIT = 256  # the largest head size flash-attn's kernels (2 and 3) take


def head_sizes(config) -> set[int | None]:
    """The attention head sizes of a model of `config` (a transformers config; a vision-language model's
    text config is read): one per layer kind where the config sets them per layer (Gemma 4), None where
    the config names none (no head_dim, no num_attention_heads)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {size or (text.hidden_size // heads if heads else None)
            for size, heads in zip(per_layer(text, "head_dim"), per_layer(text, "num_attention_heads"))}


@dataclass(frozen=True)
class Support:
    """The attention implementations a model class supports (eager: always)."""

    family: str  # config.model_type, for messages
    sdpa: bool = True
    flash: bool = False
    flex: bool = False
    flash_builds: tuple[str, ...] = ()  # non-empty: flash only through these builds (kernels hub), not the package
    largest_head: int | None = None  # the largest head size of its layers (None: not known)

    @property
    def head_fits_flash(self) -> bool:
        return self.largest_head is None or self.largest_head <= FLASH_HEAD_LIMIT

    def supported(self) -> list[str]:
        """The explicit values of `model.attn_implementation` this model accepts, best first."""
        values = [*FLASH] if self.flash and not self.flash_builds and self.head_fits_flash else []
        values += ["sdpa"] if self.sdpa else []
        values += ["flex_attention"] if self.flex else []
        return [*values, "eager"]


@dataclass(frozen=True)
class Machine:
    """The device facts `auto` depends on."""

    cuda: bool
    flash_attn: bool  # the flash-attn package (flash_attention_2's kernels) is importable

    @classmethod
    def here(cls, device=None) -> Machine:
        """This process: `device` (a torch.device or its type) if given, else whether CUDA is available."""
        if device is None:
            import torch

            cuda = torch.cuda.is_available()
        else:
            cuda = getattr(device, "type", device) == "cuda"
        return cls(cuda=cuda, flash_attn=importlib.util.find_spec("flash_attn") is not None)


def resolve(requested: str, support: Support, machine: Machine) -> tuple[str, str]:
    """(the implementation to load the model with, why); UserError for an explicit value the model does not support."""
    requested = str(requested)
    family = support.family
    if requested != AUTO:
        if requested not in support.supported():
            raise UserError(f"model.attn_implementation={requested}: {family} does not support it"
                            f"{_why_not(requested, support)}; it supports {', '.join(support.supported())} "
                            f"(or auto: the best of them this machine has)")
        return requested, "set by model.attn_implementation"
    if support.flash and not support.flash_builds and support.head_fits_flash and machine.cuda and machine.flash_attn:
        return "flash_attention_2", f"auto: a CUDA GPU with flash-attn installed, and {family} supports it"
    if support.sdpa:
        missing = ("no CUDA device" if not machine.cuda else "flash-attn not installed" if not machine.flash_attn
                   else f"{family}'s heads of {support.largest_head} are over the {FLASH_HEAD_LIMIT} its kernels take"
                   if support.flash and not support.head_fits_flash
                   else f"{family} does not run on flash-attn's kernels")
        return "sdpa", f"auto: {family} supports SDPA ({missing} for flash_attention_2)"
    return "eager", f"auto: {family} has no SDPA kernel{_why_not('sdpa', support)}, and no flash kernel here"


def _why_not(requested: str, support: Support) -> str:
    if requested in FLASH and support.flash and not support.head_fits_flash:
        return (f" (heads of {support.largest_head} in some of its layers; flash-attn's kernels take up to "
                f"{FLASH_HEAD_LIMIT})")
    if requested in FLASH and support.flash and support.flash_builds:
        return f" through the flash-attn package (its flash builds: {', '.join(support.flash_builds)})"
    if requested == "sdpa" and support.flash_builds:
        return " (attention sinks)"
    return ""


def support_of(cls, family: str, largest_head: int | None = None) -> Support:
    """What the model class `cls` supports (`family`: its config's model_type, for messages;
    `largest_head`: the largest head size of its layers, `head_sizes`); a class transformers does not
    map (None: remote code) is taken to support SDPA, as loading it always assumed."""
    if cls is None:
        return Support(family, largest_head=largest_head)
    return Support(family=family, largest_head=largest_head, sdpa=bool(getattr(cls, "_supports_sdpa", False)),
                   flash=bool(getattr(cls, "_supports_flash_attn", False) or getattr(cls, "_supports_flash_attn_2", False)),
                   flex=bool(getattr(cls, "_supports_flex_attn", False)),
                   flash_builds=tuple(getattr(cls, "_compatible_flash_implementations", None) or ()))
