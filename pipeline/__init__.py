"""Cached, restartable LoRA/EMA supervised fine-tuning of Hugging Face causal LMs."""

__version__ = "0.1.0"
