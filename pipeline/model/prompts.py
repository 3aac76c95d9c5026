"""Prompts for generation: chat messages (and their images) -> the model's inputs, and generated ids -> text.

Evaluation's exact match and the smoke test decode greedily from prompts built
here, with the chat template and the generation prompt, left-padded (a
decoder-only model continues from the right edge). A vision-language model's
prompts go through the same `ImageText` as its training data: the same
template, the same image-token expansion, pixels from the same image processor.
"""

from __future__ import annotations

import torch

from pipeline.data import turns
from pipeline.data.chat import end_of_turn
from pipeline.data.vision import ImageText


class Prompts:
    """Encoder of prompts for `model.generate`; `images` is the processor of a vision-language model."""

    def __init__(self, tokenizer, images: ImageText | None = None):
        self.tokenizer, self.images = tokenizer, images
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def eos_token_id(self) -> list[int]:
        """Ids that end a generated answer: the eos, the template's end-of-turn marker where it is
        another token (a run that added <|im_end|> to a base model whose eos is </s>), and the model's own
        stop tokens (`turns.model_stops`: GLM's <|user|>, <|observation|>), as the labels were trained."""
        ids = [self.tokenizer.eos_token_id]
        marker = end_of_turn(self.tokenizer, self.images.chat_template if self.images else None)
        if marker is not None:
            ids.append(self.tokenizer.convert_tokens_to_ids(marker))
        ids += [self.tokenizer.convert_tokens_to_ids(t) for t in turns.model_stops(self.tokenizer)]
        return list(dict.fromkeys(i for i in ids if i is not None))

    def encode(self, conversations: list[list[dict]], images: list[list[str]]) -> dict[str, torch.Tensor]:
        """Left-padded inputs (CPU tensors) of the prompts, each with its images in placeholder order."""
        if self.images is None:
            texts = [self.tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                     for m in conversations]
        else:
            texts = [self.images.expand(self.tokenizer.apply_chat_template(
                self.images.conversation(m), tokenize=False, add_generation_prompt=True,
                chat_template=self.images.chat_template), paths) for m, paths in zip(conversations, images)]
        side = self.tokenizer.padding_side
        self.tokenizer.padding_side = "left"
        try:
            batch = dict(self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False))
        finally:
            self.tokenizer.padding_side = side
        if self.images is not None:  # after the padding: a cross-attention mask spans the padded rows
            batch.update(self.images.inputs(batch["input_ids"], images))
        return batch

    def decode(self, ids: torch.Tensor) -> str:
        """The answer: generated text without special tokens, and without a leading think block."""
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if "</think>" not in text:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        answer = text.rpartition("</think>")[2]  # a reasoning model's answer follows its reasoning
        return self.tokenizer.decode(self.tokenizer(answer, add_special_tokens=False)["input_ids"],
                                     skip_special_tokens=True)
