"""Library calls whose form differs between the versions we support, chosen by feature detection.

The GPU machines carry torch 2.11 / transformers 5.17, the CI 2.13 / 5.24; peft
0.21. Each function here says which versions it bridges.
"""

from __future__ import annotations


def peft_refuses_target(model, name: str) -> str | None:
    """peft's own verdict on a LoRA target name in `model`: its error message when it refuses the
    name, None when it takes it.

    peft checks each target name against rules of its own before it adapts a
    model (0.21: `out_proj` and `conv1d` of Mamba-based families, falcon_h1 and
    nemotron_h among them, `_check_lora_target_modules_mamba`); asking it at plan
    time fails the run there rather than in the first stage. A peft without the
    check (older or renamed) refuses nothing here, and the stage's own
    `get_peft_model` has the last word.
    """
    from peft import LoraConfig
    from peft.tuners.lora import LoraModel

    check = getattr(LoraModel, "_check_target_module_compatiblity", None)  # sic: peft's spelling
    if check is None:
        return None
    try:
        check(None, LoraConfig(target_modules=[name]), model, name)  # the check does not use the tuner itself
    except ValueError as err:
        return str(err)
    except (AttributeError, TypeError):  # a peft whose check needs the tuner: left to get_peft_model
        return None
    return None


def peft_remapped_targets(model, names: list[str]) -> set[str]:
    """The layer names among `names` that peft would not adapt as layers of `model`.

    peft 0.19+ under transformers 5 rewrites a LoRA config of a mixture-of-experts
    family whose experts transformers 5 fused (Mixtral, and the Qwen2-MoE pattern:
    Qwen3-MoE, Qwen3-Next, OLMoE, ...): the transformers-4 names of the experts'
    layers (`gate_proj`, `up_proj`, `down_proj`; Mixtral `w1`, `w2`, `w3`; the
    router `gate`) move from `target_modules` to the fused weights in
    `target_parameters`, with rank and alpha doubled for `gate_up_proj`
    (`convert_peft_config_for_transformers`, run by every `get_peft_model` and
    `PeftModel.from_pretrained`). A layer of those names that is not an expert (a
    shared expert's, a dense MLP's) is then silently not adapted. Asking peft's own
    conversion which names it moves tells the caller which layers must be named
    another way. Without the conversion (older peft, transformers 4) none are moved.
    """
    if not names:
        return set()
    try:
        from peft import LoraConfig
        from peft.utils.transformers_weight_conversion import (
            convert_peft_config_for_transformers, get_model_conversion_mapping,
        )
    except ImportError:
        return set()
    config = LoraConfig(target_modules=list(names))
    convert_peft_config_for_transformers(config, model=model, conversions=get_model_conversion_mapping(model))
    kept = set(config.target_modules or ())
    return {n for n in names if n not in kept}
