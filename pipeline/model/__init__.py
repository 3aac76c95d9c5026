"""The model as training, evaluation and export all see it: below `train/` and `evaluate/`.

* `loading`     -- the model as a run's trainer config builds it (base + adapter), and the plan's checks of it
* `base`        -- the base model: loaded (quantized or not) or an empty skeleton, its decoder layers
* `attention`   -- `model.attn_implementation` resolved per model class and machine
* `targets`     -- what LoRA adapts, per module kind (fused expert weights through peft's target_parameters)
* `adapter`     -- the peft adapter on those targets
* `router`      -- a mixture of experts' load-balancing loss in the training loss
* `vocabulary`  -- rows for the special tokens the run's tokenizer added
* `trained`     -- the trained parameters and the keys saved states store them under
* `precision`   -- which autocast dtype and whether a GradScaler is needed
* `loss`        -- batches of the token cache (with pixels for a vision-language model), the next-token
                   loss (`TokenLoss`), validation loss
* `memory`      -- the GPU memory a run needs, from config.json alone (plan, activation checkpointing)
* `shapes`      -- the sizes and parameter counts of a model (config.json; its meta skeleton)
* `quantization`-- a bitsandbytes-quantized base (QLoRA)
* `vision`      -- a vision-language model's parts (language model, tower, projector) and which train
* `prompts`     -- held-out prompts (and their images) as generation inputs
* `base_keys`   -- the key a base dir stores each parameter under (Transformers 5 renames VLM modules)
* `expert_keys` -- fused expert weights: the adapter's wrappers of them and the tensors a base stores them as
"""
