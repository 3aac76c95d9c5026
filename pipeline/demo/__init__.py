"""The embedded defaults (`model: embedded` / `embedded-vlm`): a tiny pre-trained base model, its
tokenizer and a demo dataset, built on the CPU by `python -m pipeline prepare-base`.

`text` builds the causal LM, `vlm` the LLaVA-style vision-language model, `cli` the command.
"""
