"""The model as training, evaluation and export all see it: below `train/` and `evaluate/`.

* `loading`   -- base model + LoRA adapter, the trained parameters and their saved keys
* `precision` -- which autocast dtype and whether a GradScaler is needed
* `loss`      -- batches of the token cache (with pixels for a vision-language model), the next-token
                 loss (`TokenLoss`), validation loss
* `memory`    -- the GPU memory a run needs, from config.json alone (plan, activation checkpointing)
* `vision`    -- a vision-language model's parts (language model, tower, projector) and which train
* `prompts`   -- held-out prompts (and their images) as generation inputs
* `base_keys` -- the key a base dir stores each parameter under (Transformers 5 renames VLM modules)
"""
