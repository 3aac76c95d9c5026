"""The `tiny` fixture: a tiny real model, dataset and token caches for the trainer tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict:
    """A 2-layer Llama (random init), the demo tokenizer, and train/val caches."""
    import torch

    from pipeline import demo
    from pipeline.data.tokenize import load_tokenizer, tokenize_file, tokenizer_fingerprint

    root = tmp_path_factory.mktemp("tiny")
    tok = demo.build_tokenizer()
    model = demo.build_model(tok, hidden=32, layers=2, heads=2, intermediate=64, seed=0)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    paths = demo.build_dataset(root / "data", n_train=96, n_val=16, n_test=8)
    tokenizer = load_tokenizer(root / "model")
    fp = tokenizer_fingerprint(root / "model")
    for split in ("train", "val"):
        tokenize_file(paths[split], tokenizer, out_path=root / f"{split}.safetensors", max_length=64,
                      too_long="error", fingerprint=fp, split=split)
    torch.set_num_threads(1)
    return {"root": root, "model": root / "model", "train": root / "train.safetensors",
            "val": root / "val.safetensors", "test": paths["test"]}
