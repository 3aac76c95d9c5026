"""The trained parameters of a model and the keys every saved state stores them under.

Under LoRA the trained weights are the PEFT adapter tensors, stored with PEFT's
own key names (`get_peft_model_state_dict`), so a checkpoint's adapter/ is a
stock PEFT dir; an adapter on fused expert parameters (peft `ParamWrapper`,
`pipeline.model.targets`) is keyed the same way. In full fine-tuning they are
every parameter that trains, under its parameter name.
"""

from __future__ import annotations

import torch

from pipeline.errors import UserError


def trainable(model) -> list[tuple[str, torch.nn.Parameter]]:
    """Trained parameters in a fixed order; their names key every saved state."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def is_peft(model) -> bool:
    return hasattr(model, "peft_config")


def to_saved_keys(model, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameter-name keys -> the keys a checkpoint stores (PEFT's, under LoRA)."""
    if not is_peft(model):
        return named
    from peft import get_peft_model_state_dict

    # save_embedding_layers=False: only the trained tensors given are saved. ("auto" would
    # re-read the base's config at every save to spot a grown vocabulary and add the whole
    # embedding matrix; the added rows are in the adapter as trainable tokens already.)
    return get_peft_model_state_dict(model, state_dict=named, save_embedding_layers=False)


def saved_key_map(model, names: list[str]) -> dict[str, str]:
    """saved key -> parameter name, for the trained parameters."""
    params = dict(model.named_parameters())
    by_id = {id(params[n]): n for n in names}
    saved = to_saved_keys(model, {n: params[n] for n in names})
    mapping = {key: by_id[id(t)] for key, t in saved.items() if id(t) in by_id}
    if len(mapping) != len(names):
        raise RuntimeError(f"cannot map {len(names) - len(mapping)} trained parameters to saved keys")
    return mapping


def trained_state(model, names: list[str]) -> dict[str, torch.Tensor]:
    """CPU copies of the trained weights under their saved keys."""
    params = dict(model.named_parameters())
    return {key: params[n].detach().to("cpu", copy=True).contiguous() for key, n in saved_key_map(model, names).items()}


@torch.no_grad()
def load_trained(model, names: list[str], tensors: dict[str, torch.Tensor], source: str) -> None:
    """Copy saved trained weights into the live parameters, exactly, or fail."""
    mapping = saved_key_map(model, names)
    missing = sorted(set(mapping) - set(tensors))
    unexpected = sorted(set(tensors) - set(mapping))
    if missing or unexpected:
        raise UserError(
            f"{source} does not match the model being trained: "
            f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''} "
            "(was it trained with another lora/model config?)"
        )
    params = dict(model.named_parameters())
    for key, name in mapping.items():
        params[name].copy_(tensors[key])


def named_to_param_names(model, names: list[str], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Saved-key tensors -> parameter-name keys (to load EMA shadows)."""
    mapping = saved_key_map(model, names)
    return {mapping[k]: v for k, v in tensors.items() if k in mapping}
