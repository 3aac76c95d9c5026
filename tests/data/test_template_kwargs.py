"""`data.chat_template_kwargs` (`pipeline.data.template_vars`): a template's switches, fixed for the run.

On the shipped templates of the corpus (tests/data/chat_templates/, verbatim from the model makers via TRL):
Qwen3.6's ``preserve_thinking`` renders, so trains, the reasoning of turns before the last user message, which
its default drops; Nemotron 3's ``truncate_history_thinking: false`` does the same; Qwen3.5's
``enable_thinking: false`` is the generation prompt every stage renders (evaluation, the exported tokenizer),
which a caller can still override. A misspelt switch is refused, naming what the template reads. A
vision-language model's processor template (Qwen3.5's, in its copied processor files) takes them too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kits.chat as chatkit
from pipeline.data import prepare
from pipeline.data.cache import IGNORE_INDEX
from pipeline.data.formats import Record
from pipeline.data.tokenize import encode_records, load_tokenizer, tokenizer_fingerprint
from pipeline.errors import UserError

USER = {"role": "user", "content": "Pick a number."}
CONVERSATION = [USER, {"role": "assistant", "content": "Seven.", "reasoning_content": "Any will do; seven."},
                {"role": "user", "content": "Double it."},
                {"role": "assistant", "content": "Fourteen.", "reasoning_content": "Seven times two."}]


def _run_tokenizer(family: str, out: Path, kwargs: dict | None):
    model_dir = Path(chatkit.build_tokenizer(family).name_or_path)  # tokenizer files + generation_config.json
    info = prepare.prepare(model_dir, out, None, kwargs)
    assert info["template_kwargs"] == (kwargs or {})
    return load_tokenizer(out)


def _trained(tokenizer, messages) -> tuple[list[str], dict]:
    """The supervised runs of one record, as text, and the split's stats."""
    record = Record(id="r", messages=[dict(m) for m in messages], images=[], index=0, line=1)
    enc = encode_records([record], tokenizer, max_length=1 << 14, too_long="error")
    ids, labels = enc.input_ids.tolist(), enc.labels.tolist()
    runs, run = [], []
    for token, label in zip(ids, labels):
        if label != IGNORE_INDEX:
            run.append(token)
        elif run:
            runs.append(tokenizer.decode(run))
            run = []
    return runs + ([tokenizer.decode(run)] if run else []), enc.stats


@pytest.mark.parametrize(("family", "switch"), [("qwen3.6", {"preserve_thinking": True}),
                                                ("nemotron-3-nano", {"truncate_history_thinking": False})])
def test_a_switch_that_keeps_earlier_reasoning_trains_it(family, switch, tmp_path):
    default, stats = _trained(_run_tokenizer(family, tmp_path / "default", None), CONVERSATION)
    assert stats["reasoning_dropped_by_template"] == 1 and "Any will do" not in "".join(default)
    kept, stats = _trained(_run_tokenizer(family, tmp_path / "kept", switch), CONVERSATION)
    assert stats["reasoning_dropped_by_template"] == 0 and stats["reasoning_dropped"] == 0
    assert "Any will do; seven." in kept[0] and kept[0].rstrip().endswith(("Seven.<|im_end|>", "Seven.\n<|im_end|>"))
    assert "Seven times two." in kept[1]
    # The cache of one is not the cache of the other: the template is part of the tokenizer's fingerprint.
    assert tokenizer_fingerprint(tmp_path / "default") != tokenizer_fingerprint(tmp_path / "kept")


def test_enable_thinking_false_is_the_prompt_every_stage_renders_and_a_caller_may_override_it(tmp_path):
    tokenizer = _run_tokenizer("qwen3.5", tmp_path / "tok", {"enable_thinking": False})
    prompt = tokenizer.apply_chat_template([USER], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    override = tokenizer.apply_chat_template([USER], tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert override.endswith("<|im_start|>assistant\n<think>\n")
    default = _run_tokenizer("qwen3.5", tmp_path / "default", None)
    assert default.apply_chat_template([USER], tokenize=False, add_generation_prompt=True).endswith("<think>\n")
    chat = json.loads((tmp_path / "tok" / "chat.json").read_text())
    assert chat["template_kwargs"] == {"enable_thinking": False}
    # Evaluation's and the smoke test's prompts (pipeline.model.prompts) end in the empty think block too
    from pipeline.model.prompts import Prompts

    ids = Prompts(tokenizer).encode([[USER]], [[]])["input_ids"][0].tolist()
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_switch_the_template_never_reads_is_refused_naming_the_ones_it_does(tmp_path):
    with pytest.raises(UserError) as err:
        _run_tokenizer("qwen3.5", tmp_path / "tok", {"enable_thinkng": False})
    message = str(err.value)
    assert "data.chat_template_kwargs" in message and "'enable_thinkng'" in message
    assert "enable_thinking" in message  # what the template does read
    assert not (tmp_path / "tok").exists()
    with pytest.raises(UserError, match="cannot name a template variable"):
        _run_tokenizer("qwen3.5", tmp_path / "tok2", {"enable thinking": False})


# shipped template -> (switches it reads from its caller, names it only sets itself before reading them)
READS = {
    "qwen3.jinja": ({"enable_thinking", "tools"}, {"content", "reasoning_content"}),
    "gpt-oss.jinja": ({"reasoning_effort", "model_identity", "builtin_tools", "tools"},
                      {"developer_message", "loop_messages", "tool_call"}),
    "command-r7b-12-2024-tool_use.jinja": ({"developer_preamble", "documents", "enable_citations", "tools"}, set()),
    "lfm2.5.jinja": ({"preserve_thinking", "tools"}, {"content", "_ns"}),
    "gemma-3-it.jinja": (set(), {"first_user_prefix", "loop_messages", "role"}),
    "nemotron-3-nano.jinja": ({"enable_thinking", "truncate_history_thinking"}, {"content", "include_content", "c"}),
}


@pytest.mark.parametrize("name", sorted(READS))
def test_the_variables_a_shipped_template_reads_are_its_callers_not_its_own(name):
    """What a refused name's message lists: a switch read before any set, or asked `is defined`; not a name
    the template sets on every path before reading it (Jinja's analysis alone reports both)."""
    from pipeline.data.template_vars import read_variables

    switches, own = READS[name]
    read = read_variables((chatkit.TEMPLATES_DIR / name).read_text())
    assert switches | {"messages"} <= read and not own & read, (sorted(read), own & read)


def test_values_of_every_json_kind_survive_as_the_templates_defaults():
    from pipeline.data.template_vars import with_defaults

    values = {"a": None, "b": True, "c": 3, "d": 0.25, "e": 'quote " and \\ and é\n', "f": [1, "x", False],
              "g": {"k": [None]}}
    template = "{{ [a, b, c, d, e, f, g] | tojson }}"
    import jinja2

    rendered = jinja2.Environment().from_string(with_defaults(template, values, where="t")).render()
    assert json.loads(rendered) == list(values.values())
    explicit = jinja2.Environment().from_string(with_defaults(template, values, where="t")).render(c=4)
    assert json.loads(explicit)[2] == 4  # a caller's value wins over the default


def test_a_vision_language_processor_template_takes_them(tmp_path):
    from kits.vlm import save_qwen_vl

    from pipeline.data.vision import load_image_text

    model = save_qwen_vl(tmp_path / "model", "qwen3_5")
    prepare.prepare(model, tmp_path / "tok", None, {"enable_thinking": False})
    images = load_image_text(tmp_path / "tok")
    conversation = images.conversation([{"role": "user", "content": "<image>What colour?"}])
    prompt = images.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                                  chat_template=images.chat_template)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert json.loads((tmp_path / "tok" / "chat.json").read_text())["template_kwargs"] == {"enable_thinking": False}
