"""Tiny character-level tokenizers carrying the chat templates that model makers ship (and ours).

`build_tokenizer(family)` returns a fast Hugging Face tokenizer whose
vocabulary is the printable ASCII characters, the newline and the family's
special tokens (each one token), with the family's bos / eos / pad as in its
real ``tokenizer_config.json`` and ``chat_template`` = the shipped template from
``tests/data/chat_templates/`` (see the README there); a built-in training
template's family is ``builtin:<name>`` (`BUILTINS`). Every other character is
one token, so the ids of any text are known without the tokenizer:
`char_ids` computes them independently (greedy longest special-token match,
else one id per character), which is what the tests compare the labelling with.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

TEMPLATES_DIR = Path(__file__).resolve().parents[1] / "data" / "chat_templates"

UNK = "<unk>"
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # printable ASCII incl. space and "\n"


@dataclass(frozen=True)
class Family:
    """One model family: its shipped template file and the real tokenizer's special tokens."""

    name: str
    template: str  # file name in TEMPLATES_DIR
    eot: str  # what is trained right after an assistant turn's content: through the token generation stops on
    specials: tuple[str, ...]
    bos: str | None = None
    eos: str | None = None
    pad: str | None = None
    unk: str | None = None
    system: str = "ok"  # "ok" | "raises" (the template rejects a system message)
    reasoning: str | None = None  # None | "qwen3" (rendered after the last user turn) | "r1" (never rendered)
    # | "gpt-oss" (the analysis channel of a last assistant turn only) | one of test_chat_templates' _AFTER_PROMPT
    # The tokens generation stops on: the eos ids of the model's generation_config.json (data, not derived).
    stops: tuple[str, ...] = ()
    lead: str = ""  # what the model writes before the content: template text after the generation prompt
    mid_eot: str | None = None  # what is trained after the content of a turn that a later turn follows (None: eot)
    # The template writes no stop token after a last assistant turn: the labeller appends the eos (then `eot`).
    appends: bool = False


_LLAMA3 = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<|eom_id|>", "<|python_tag|>")
_QWEN = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
_QWEN3 = _QWEN + ("<think>", "</think>", "<tool_response>", "</tool_response>")
_R1 = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
       "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
       "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
       "<｜tool▁output▁end｜>")
_MISTRAL = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
            "[TOOL_RESULTS]", "[/TOOL_RESULTS]")
_MISTRAL_SMALL3 = _MISTRAL + ("<pad>", "[IMG]", "[IMG_BREAK]", "[IMG_END]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")
_GEMMA = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
_GEMMA4 = ("<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>", "<|tool>",
           "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>', "<|image|>",
           "<|audio|>", "<|video|>")
_PHI35 = ("<unk>", "<s>", "</s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
_HARMONY = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
            "<|message|>", "<|call|>")
_COHERE = ("<PAD>", "<UNK>", "<CLS>", "<SEP>", "<MASK_TOKEN>", "<BOS_TOKEN>", "<EOS_TOKEN>", "<EOP_TOKEN>",
           "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>")
_COHERE2 = ("<PAD>", "<UNK>", "<CLS>", "<SEP>", "<MASK_TOKEN>", "<BOS_TOKEN>", "<EOS_TOKEN>", "<EOP_TOKEN>",
            "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>",
            "<|SYSTEM_TOKEN|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_THINKING|>", "<|END_THINKING|>",
            "<|START_ACTION|>", "<|END_ACTION|>", "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>")

_GLM = ("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>", "<|assistant|>",
        "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
        "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")

_QWEN3_5 = _QWEN3 + ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
_QWEN_VL = _QWEN + ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
_NEMOTRON3 = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
              "<tool_response>", "</tool_response>")
_LFM2 = ("<|pad|>", "<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|tool_list_start|>", "<|tool_list_end|>",
         "<|tool_call_start|>", "<|tool_call_end|>", "<|tool_response_start|>", "<|tool_response_end|>")
_LFM2_5 = _LFM2 + ("<think>", "</think>", "<image>")

_L31_STOPS = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")
_QWEN_STOPS = ("<|im_end|>", "<|endoftext|>")
_R1_STOPS = ("<｜end▁of▁sentence｜>",)

FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("llama-3.1", "llama-3.1-8b-instruct.jinja", "<|eot_id|>", _LLAMA3,
           bos="<|begin_of_text|>", eos="<|eot_id|>", stops=_L31_STOPS),
    Family("llama-3.2", "llama-3.2-instruct.jinja", "<|eot_id|>", _LLAMA3,
           bos="<|begin_of_text|>", eos="<|eot_id|>", stops=_L31_STOPS),
    Family("llama-3", "llama-3-8b-instruct.jinja", "<|eot_id|>", _LLAMA3,
           bos="<|begin_of_text|>", eos="<|eot_id|>", stops=("<|end_of_text|>", "<|eot_id|>")),
    Family("qwen2.5", "qwen2.5-instruct.jinja", "<|im_end|>", _QWEN,
           eos="<|im_end|>", pad="<|endoftext|>", stops=_QWEN_STOPS),
    Family("qwen3", "qwen3.jinja", "<|im_end|>", _QWEN3,
           eos="<|im_end|>", pad="<|endoftext|>", reasoning="qwen3", stops=_QWEN_STOPS),
    Family("qwen3-2025-04", "qwen3-2025-04.jinja", "<|im_end|>", _QWEN3,
           eos="<|im_end|>", pad="<|endoftext|>", reasoning="qwen3", stops=_QWEN_STOPS),
    Family("r1-distill", "deepseek-r1-distill.jinja", "<｜end▁of▁sentence｜>", _R1,
           bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", pad="<｜end▁of▁sentence｜>", reasoning="r1",
           stops=_R1_STOPS),
    Family("r1-distill-2025-01", "deepseek-r1-distill-2025-01.jinja", "<｜end▁of▁sentence｜>", _R1,
           bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", pad="<｜end▁of▁sentence｜>", reasoning="r1",
           stops=_R1_STOPS),
    # GLM-4.5: a turn ends where the model writes the next turn's header (<|user|>, <|observation|>: stops of its
    # generation config); after a last turn the template writes nothing, so the labeller appends the eos
    Family("glm-4.5", "glm-4.5.jinja", "<|endoftext|>", _GLM, eos="<|endoftext|>", pad="<|endoftext|>",
           mid_eot="<|user|>", appends=True, stops=("<|endoftext|>", "<|user|>", "<|observation|>")),
    # DeepSeek-V3 (and V3-0324): R1's vocabulary and eos, no reasoning in the template
    Family("deepseek-v3", "deepseek-v3.jinja", "<｜end▁of▁sentence｜>", _R1,
           bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", pad="<｜end▁of▁sentence｜>", stops=_R1_STOPS),
    # DeepSeek-V3.1: hybrid thinking, off unless `thinking`: the generation prompt then ends in </think>, which an
    # answer's turn renders too; reasoning inline in the content is cut off (the part after </think> is rendered)
    Family("deepseek-v3.1", "deepseek-v3.1.jinja", "<｜end▁of▁sentence｜>", _R1,
           bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", pad="<｜end▁of▁sentence｜>", stops=_R1_STOPS),
    Family("mistral-nemo", "mistral-nemo-instruct-2407.jinja", "</s>", _MISTRAL,
           bos="<s>", eos="</s>", unk="<unk>", stops=("</s>",)),
    # Mistral Small 3.1: a system prompt always (a dated default when none is given), no generation prompt (the
    # prompt is the render through [/INST]), an answer closed by the eos
    Family("mistral-small-3.1", "mistral-small-3.1-24b-instruct-2503.jinja", "</s>", _MISTRAL_SMALL3,
           bos="<s>", eos="</s>", pad="<pad>", unk="<unk>", stops=("</s>",)),
    # Mistral-7B-Instruct-v0.2: [INST] / [/INST] written as plain text (the vocabulary of Mistral's first tokenizer,
    # Mixtral-8x7B's too, holds no such tokens), no generation prompt, user and assistant turns only
    Family("mistral-7b-v0.2", "mistral-7b-instruct-v0.2.jinja", "</s>", ("<unk>", "<s>", "</s>"),
           bos="<s>", eos="</s>", unk="<unk>", system="raises", stops=("</s>",)),
    Family("gemma-2", "gemma-2-it.jinja", "<end_of_turn>", _GEMMA,
           bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>", system="raises", stops=("<eos>", "<end_of_turn>")),
    Family("gemma-3", "gemma-3-it.jinja", "<end_of_turn>", _GEMMA,
           bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>", stops=("<eos>", "<end_of_turn>")),
    # Gemma 4: <|turn>model ... <turn|>; its generation prompt adds an empty thought channel
    # (<|channel>thought\n<channel|>) that a rendered model turn does not hold: the turn is trained as rendered, as
    # TRL's gemma4_training.jinja trains it. It renders <think> text in a turn's content as it is (it strips only its
    # own channel), so reasoning is content to it, as to the families without reasoning here.
    Family("gemma-4", "gemma-4.jinja", "<turn|>", _GEMMA4, bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>",
           stops=("<eos>", "<turn|>")),
    # Phi-3 (mini, small, medium): Phi-3.5's format, and the eos after the last turn of a render without a
    # generation prompt
    Family("phi-3", "phi-3-mini-instruct.jinja", "<|end|>", _PHI35,
           bos="<s>", eos="<|endoftext|>", pad="<|endoftext|>", unk="<unk>",
           stops=("<|end|>", "<|assistant|>", "<|endoftext|>")),
    Family("phi-3.5", "phi-3.5-mini-instruct.jinja", "<|end|>", _PHI35,
           bos="<s>", eos="<|endoftext|>", pad="<|endoftext|>", unk="<unk>",
           stops=("<|end|>", "<|assistant|>", "<|endoftext|>")),
    # Harmony: the generation prompt is only <|start|>assistant, so the channel header is model output; a
    # final message closes with <|return|> when last, with <|end|> (not a stop) when a later turn follows.
    Family("gpt-oss", "gpt-oss.jinja", "<|return|>", _HARMONY, eos="<|return|>", pad="<|endoftext|>",
           reasoning="gpt-oss", lead="<|channel|>final<|message|>", mid_eot="",
           stops=("<|return|>", "<|endoftext|>", "<|call|>")),
    # Command R7B: the eos <|END_OF_TURN_TOKEN|> follows <|END_RESPONSE|>; the R7B generation prompt stops
    # before <|START_RESPONSE|>, the Cohere2 one after it.
    Family("command-r7b", "command-r7b-12-2024-tool_use.jinja", "<|END_RESPONSE|><|END_OF_TURN_TOKEN|>", _COHERE2,
           bos="<BOS_TOKEN>", eos="<|END_OF_TURN_TOKEN|>", pad="<PAD>", lead="<|START_RESPONSE|>",
           stops=("<|END_OF_TURN_TOKEN|>",)),
    # Command R (c4ai-command-r-v01, the first Cohere chat format): turns must alternate, content is stripped
    Family("command-r", "command-r.jinja", "<|END_OF_TURN_TOKEN|>", _COHERE, bos="<BOS_TOKEN>",
           eos="<|END_OF_TURN_TOKEN|>", pad="<PAD>", stops=("<|END_OF_TURN_TOKEN|>",)),
    Family("cohere2", "cohere2.jinja", "<|END_RESPONSE|><|END_OF_TURN_TOKEN|>", _COHERE2,
           bos="<BOS_TOKEN>", eos="<|END_OF_TURN_TOKEN|>", pad="<PAD>", stops=("<|END_OF_TURN_TOKEN|>",)),
    # Qwen3-Instruct-2507: Qwen3's vocabulary, no thinking mode
    Family("qwen3-instruct-2507", "qwen3-instruct-2507.jinja", "<|im_end|>", _QWEN3,
           eos="<|im_end|>", pad="<|endoftext|>", stops=_QWEN_STOPS),
    # Qwen3.5 (4B and up) and Qwen3.6: the generation prompt ends in <think>\n (thinking on): the reasoning where
    # given is model output, the close of an empty block stays prompt; earlier turns render no reasoning
    Family("qwen3.5", "qwen3.5.jinja", "<|im_end|>", _QWEN3_5, eos="<|im_end|>", pad="<|endoftext|>",
           reasoning="qwen3.5", stops=_QWEN_STOPS),
    Family("qwen3.6", "qwen3.6.jinja", "<|im_end|>", _QWEN3_5, eos="<|im_end|>", pad="<|endoftext|>",
           reasoning="qwen3.5", stops=_QWEN_STOPS),
    # Qwen3.5 up to 2B: thinking off, the generation prompt holds the empty think block
    Family("qwen3.5-small", "qwen3.5-small.jinja", "<|im_end|>", _QWEN3_5, eos="<|im_end|>", pad="<|endoftext|>",
           reasoning="qwen3.5", stops=_QWEN_STOPS),
    # Nemotron 3 Nano: the generation prompt ends in <think>\n; a turn without reasoning renders <think></think>,
    # whose close stays prompt
    Family("nemotron-3-nano", "nemotron-3-nano.jinja", "<|im_end|>", _NEMOTRON3, bos="<s>", eos="<|im_end|>",
           pad="<unk>", unk="<unk>", reasoning="nemotron", stops=("</s>", "<|im_end|>")),
    Family("nemotron-3-super", "nemotron-3-super.jinja", "<|im_end|>", _NEMOTRON3, bos="<s>", eos="<|im_end|>",
           pad="<unk>", unk="<unk>", reasoning="nemotron", stops=("</s>", "<|im_end|>")),
    Family("nemotron-3-ultra", "nemotron-3-ultra.jinja", "<|im_end|>", _NEMOTRON3, bos="<s>", eos="<|im_end|>",
           pad="<unk>", unk="<unk>", reasoning="nemotron-ultra", stops=("</s>", "<|im_end|>")),
    # Qwen2.5-VL (and Qwen2-VL, byte-identical) and Qwen3-VL: ChatML with vision tokens for image parts; Qwen2.5-VL
    # writes a default system prompt when none is given; neither renders reasoning
    Family("qwen2.5-vl", "qwen2.5-vl.jinja", "<|im_end|>", _QWEN_VL, eos="<|im_end|>", pad="<|endoftext|>",
           stops=_QWEN_STOPS),
    Family("qwen3-vl", "qwen3-vl.jinja", "<|im_end|>", _QWEN_VL, eos="<|im_end|>", pad="<|endoftext|>",
           stops=_QWEN_STOPS),
    Family("lfm2", "lfm2.jinja", "<|im_end|>", _LFM2, bos="<|startoftext|>", eos="<|im_end|>", pad="<|pad|>",
           stops=("<|im_end|>",)),
    # LFM2.5: reads reasoning from `thinking`, written <think>...</think> with no newlines, last turns only
    Family("lfm2.5", "lfm2.5.jinja", "<|im_end|>", _LFM2_5, bos="<|startoftext|>", eos="<|im_end|>", pad="<|pad|>",
           reasoning="lfm2.5", stops=("<|im_end|>",)),
]}



def _builtin_families() -> dict[str, Family]:
    """Our built-in training templates (`pipeline.data.chat.BUILTIN_TEMPLATES`) as families named
    ``builtin:<name>``: a base vocabulary with ``<s>`` / ``</s>`` and the template's turn markers; generation
    stops on the eos and on the end-of-turn marker the registry declares (export adds it to the model's
    generation config)."""
    from pipeline.data.chat import BUILTIN_TEMPLATES

    out = {}
    for name, spec in BUILTIN_TEMPLATES.items():
        eot = spec.end_of_turn or "</s>"
        out[f"builtin:{name}"] = Family(
            f"builtin:{name}", str(Path(spec.template_path)), eot, (*spec.special_tokens, "<s>", "</s>"),
            bos="<s>", eos="</s>", stops=tuple(dict.fromkeys((eot, "</s>"))),
            lead="<|channel|>final<|message|>" if name == "gpt-oss" else "")
    return out


BUILTINS: dict[str, Family] = _builtin_families()


def family_of(name: str) -> Family:
    """A shipped template's family (`FAMILIES`) or a built-in's (`BUILTINS`, ``builtin:<name>``)."""
    return FAMILIES[name] if name in FAMILIES else BUILTINS[name]


def template_text(name: str) -> str:
    return (TEMPLATES_DIR / family_of(name).template).read_text(encoding="utf-8")


def vocabulary(family: str) -> dict[str, int]:
    """Token -> id: the special tokens first (with <unk>), then one id per character."""
    fam = family_of(family)
    vocab: dict[str, int] = {}
    for tok in (*fam.specials, UNK):
        vocab.setdefault(tok, len(vocab))
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    return vocab


@lru_cache(maxsize=None)
def build_tokenizer(family: str):
    """The family's tiny fast tokenizer (cached: build once per family), loaded from a dir that also holds
    the model's ``generation_config.json`` (``eos_token_id``: the family's `Family.stops`), as a model dir
    does: the labeller reads the tokens generation stops on from there."""
    import json
    import tempfile

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    fam = family_of(family)
    tok = Tokenizer(models.WordLevel(vocab=vocabulary(family), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*fam.specials, UNK)])
    built = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=fam.bos,
        eos_token=fam.eos,
        pad_token=fam.pad,
        unk_token=fam.unk or UNK,
        chat_template=template_text(family),
        model_max_length=1 << 20,
    )
    where = Path(tempfile.mkdtemp(prefix="chatkit-"))
    built.save_pretrained(where)
    stops = [vocabulary(family)[t] for t in fam.stops]
    (where / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}) + "\n")
    return PreTrainedTokenizerFast.from_pretrained(where)


def char_ids(family: str, text: str) -> list[int]:
    """The ids of `text`, computed without the tokenizer: special tokens whole, else one per character."""
    vocab = vocabulary(family)
    specials = sorted((*family_of(family).specials, UNK), key=len, reverse=True)
    ids, i = [], 0
    while i < len(text):
        for tok in specials:
            if text.startswith(tok, i):
                ids.append(vocab[tok])
                i += len(tok)
                break
        else:
            ids.append(vocab.get(text[i], vocab[UNK]))
            i += 1
    return ids
