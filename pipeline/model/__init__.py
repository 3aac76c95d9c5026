"""The model as training, evaluation and export all see it: below `train/` and `evaluate/`.

* `loading`   -- base model + LoRA adapter, the trained parameters and their saved keys
* `precision` -- which autocast dtype and whether a GradScaler is needed
* `loss`      -- batches of the token cache, the next-token loss (`TokenLoss`), validation loss
* `memory`    -- the GPU memory a run needs, from config.json alone (plan, activation checkpointing)
"""
