"""The embedded default: a tiny base model, its tokenizer and a demo dataset.

Nothing is downloaded. `prepare_base` writes real Hugging Face directories
(`save_pretrained`), so everything downstream runs through exactly the code a
real model takes.

Why a pre-trained base: LoRA on a random-init base learns nothing useful in
minutes (embeddings and head stay frozen and random). A real base model comes
pre-trained on skills; SFT teaches it the assistant format. We mimic that: the
base is pre-trained briefly on raw "word=word" copy lines, and the SFT task asks
for the same skill in a chat format it has never seen ("repeat: word" inside the
chat template). Held-out exact match is ~0 for the base and high after LoRA.
"""

from __future__ import annotations

import json
import logging
import random
import string
import time
from pathlib import Path

import torch

from pipeline.data.cache import IGNORE_INDEX

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
ALPHABET = string.ascii_lowercase + string.digits + " \n:=.,?!'-"

# Role headers and <|end|> per message; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

INSTRUCTION = "repeat: {word}"
PRETRAIN_LINE = "{word}={word}"


def build_tokenizer():
    """A character-level fast tokenizer with the special tokens and chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in ALPHABET:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|end|>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )


def build_model(tokenizer, *, hidden=128, layers=4, heads=4, intermediate=256, seed=0):
    """A random-init Llama-style causal LM sized for a CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def random_word(rng: random.Random, lo: int = 3, hi: int = 7) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(lo, hi)))


def train_from_scratch(model, batches, *, steps: int, lr: float, seed: int) -> float:
    """Train every weight of `model` for `steps` updates (AdamW, one-cycle schedule) on
    `batches(rng)` -> (model inputs, labels), `rng` seeded from `seed`; leaves the model in eval
    mode and returns the seconds it took. How the demo bases learn their skill before any SFT."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    t0 = time.time()
    for step in range(steps):
        inputs, labels = batches(rng)
        loss = model(**inputs, labels=labels).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0:
            log.info("pretrain step %d loss %.4f", step, loss.item())
    model.eval()
    return round(time.time() - t0, 1)


def pretrain(model, tokenizer, *, steps=200, batch=64, lr=3e-3, seed=0) -> dict:
    """Teach the base the raw copy skill; returns its held-out exact match."""
    def copy_lines(rng):
        lines = [
            tokenizer.bos_token + PRETRAIN_LINE.format(word=random_word(rng)) + tokenizer.eos_token
            for _ in range(batch)
        ]
        enc = tokenizer(lines, return_tensors="pt", padding=True, add_special_tokens=False)
        return enc, enc["input_ids"].masked_fill(enc["attention_mask"] == 0, IGNORE_INDEX)

    seconds = train_from_scratch(model, copy_lines, steps=steps, lr=lr, seed=seed)
    prompts = [random_word(random.Random(10_000 + i)) for i in range(64)]
    correct = 0
    for word in prompts:
        ids = tokenizer(tokenizer.bos_token + word + "=", return_tensors="pt", add_special_tokens=False)
        out = model.generate(**ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        correct += text == word
    return {"steps": steps, "seconds": seconds, "copy_exact_match": correct / len(prompts)}


def conversation(word: str, idx: int, split: str) -> dict:
    """One record in the LLaVA/ShareGPT `conversations` format."""
    return {
        "id": f"{split}-{idx:05d}",
        "conversations": [
            {"from": "human", "value": INSTRUCTION.format(word=word)},
            {"from": "gpt", "value": word},
        ],
    }


def build_dataset(out_dir: Path, *, n_train=2000, n_val=128, n_test=64, seed=1) -> dict[str, Path]:
    """Disjoint train / val / held-out test splits of the demo task as JSONL."""
    rng = random.Random(seed)
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < n_train + n_val + n_test:
        w = random_word(rng)
        if w not in seen:
            seen.add(w)
            words.append(w)
    splits = {
        "train": words[:n_train],
        "val": words[n_train:n_train + n_val],
        "test": words[n_train + n_val:],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, ws in splits.items():
        path = out_dir / f"{split}.jsonl"
        with path.open("w") as f:
            for i, w in enumerate(ws):
                f.write(json.dumps(conversation(w, i, split)) + "\n")
        paths[split] = path
    return paths


# Tokens of a demo record around its phrase, which appears twice (the instruction, the answer): <s>,
# two role headers with their newlines, "repeat: ", two <|end|> with theirs (the char tokenizer).
_RECORD_OVERHEAD = 1 + 2 * 2 + len(INSTRUCTION.format(word="")) + 2 * 2


def build_mixed_dataset(out_dir: Path, *, lengths: tuple[int, int] = (32, 512), n_train=2000, n_val=128,
                        seed=1) -> dict[str, Path]:
    """The demo task at mixed lengths: records of about lengths[0]..lengths[1] tokens (uniform), each
    asking to repeat a phrase of random words sized to its length. For the packing tests and
    benchmark (`pipeline.planning.packing`); the embedded default run uses `build_dataset`."""
    rng = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n in (("train", n_train), ("val", n_val)):
        path = out_dir / f"{split}.jsonl"
        with path.open("w") as f:
            for i in range(n):
                size = max(1, (rng.randint(*lengths) - _RECORD_OVERHEAD) // 2)
                phrase = ""
                while len(phrase) < size:
                    phrase += random_word(rng) + " "
                phrase = phrase[:size - 1] + "a"  # exactly `size` characters, none of them a trailing space
                f.write(json.dumps(conversation(phrase, i, split)) + "\n")
        paths[split] = path
    return paths


def prepare_base(model_dir: Path, data_dir: Path, *, pretrain_steps: int = 200, seed: int = 0) -> dict:
    """Build, pre-train and save the embedded base model and the demo dataset."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=seed)
    report = pretrain(model, tokenizer, steps=pretrain_steps, seed=seed)
    save_base(model, tokenizer, Path(model_dir), report, pad_token_id=tokenizer.pad_token_id)
    build_dataset(Path(data_dir))
    return report


def save_base(model, beside, model_dir: Path, report: dict, *, pad_token_id: int) -> None:
    """Save a demo base as a Hugging Face dir: the model, `beside` it its tokenizer (or processor),
    and the pre-training report."""
    model.generation_config.pad_token_id = pad_token_id
    model.save_pretrained(model_dir)
    beside.save_pretrained(model_dir)
    (model_dir / "pretrain_report.json").write_text(json.dumps(report, indent=2) + "\n")
