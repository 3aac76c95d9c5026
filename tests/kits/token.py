"""Tiny base models WITHOUT a chat template, for the added-special-token tests.

`make_base(root, template)` writes a base model dir whose tokenizer has no chat
template (a base model), prepares the run's tokenizer with a built-in template
(`pipeline.data.prepare`), and tokenizes the demo dataset with it:

* ``chatml``: the vocabulary lacks ``<|im_start|>`` / ``<|im_end|>``; they are added;
* ``llama3``: the vocabulary has ``<|start_header_id|>``, ``<|end_header_id|>`` and
  ``<|eot_id|>`` as special tokens already; nothing is added.
"""

from __future__ import annotations

from pathlib import Path

LLAMA3_MARKERS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def base_tokenizer(extra_special: list[str] = ()):
    """The demo's character-level tokenizer without its chat template, plus `extra_special` tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pipeline.demo.text import ALPHABET

    special = ["<pad>", "<unk>", "<s>", "</s>", *extra_special]
    vocab = {tok: i for i, tok in enumerate(special)}
    for ch in ALPHABET:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(special)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=512)


def make_base(root: Path, template: str, *, tied: bool = False) -> dict:
    """Base dir (no chat template), run tokenizer dir, train/val caches; paths in a dict."""
    import torch

    from pipeline.demo import text as demo
    from pipeline.data.prepare import prepare
    from pipeline.data.tokenize import load_tokenizer, tokenize_file, tokenizer_fingerprint

    root.mkdir(parents=True, exist_ok=True)
    tok = base_tokenizer(LLAMA3_MARKERS if template == "llama3" else [])
    assert not tok.chat_template
    model = demo.build_model(tok, hidden=32, layers=2, heads=2, intermediate=64, seed=0)
    if tied:
        from transformers import LlamaForCausalLM

        model.config.tie_word_embeddings = True
        torch.manual_seed(0)
        model = LlamaForCausalLM(model.config)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    info = prepare(root / "model", root / "tokenizer", template)
    paths = demo.build_dataset(root / "data", n_train=48, n_val=8, n_test=4)
    tokenizer = load_tokenizer(root / "tokenizer")
    fp = tokenizer_fingerprint(root / "tokenizer")
    for split in ("train", "val"):
        tokenize_file(paths[split], tokenizer, out_path=root / f"{split}.safetensors", max_length=96,
                      too_long="error", fingerprint=fp, split=split)
    return {"root": root, "model": root / "model", "tokenizer": root / "tokenizer", "train": root / "train.safetensors",
            "val": root / "val.safetensors", "test": paths["test"], "chat": info}
