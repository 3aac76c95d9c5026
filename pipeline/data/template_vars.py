"""`data.chat_template_kwargs`: variables a chat template reads, fixed for the run as the template's defaults.

Templates of 2026 read switches beside the messages: Qwen3's and Qwen3.5's
``enable_thinking``, Qwen3.6's and LFM2.5's ``preserve_thinking`` (every turn's
reasoning rendered, not only the last one's), Nemotron 3's
``truncate_history_thinking``. A run chooses them once. `with_defaults` writes
them at the head of the run tokenizer's template as defaults
(``{%- set enable_thinking = enable_thinking if enable_thinking is defined else false %}``),
so everything that renders with the run tokenizer renders alike without passing
anything: the labels (validation, tokenization), the prompts of evaluation and
of the smoke test, and a stock ``apply_chat_template`` on the exported
tokenizer; a caller can still pass another value explicitly. A name the
template never reads is refused (a misspelt switch would otherwise change
nothing, silently).
"""

from __future__ import annotations

import json
import re

from pipeline.errors import UserError

SETTING = "data.chat_template_kwargs"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Tags of transformers' own extension (assistant masks), unknown to a plain Jinja parser; dropped for analysis only.
_GENERATION_TAGS = re.compile(r"{%-?\s*(?:generation|endgeneration)\s*-?%}")


def _literal(value, key: str) -> str:
    """`value` as a Jinja expression that evaluates to it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a double-quoted literal with \\uXXXX escapes, which Jinja decodes
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v, key) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_literal(v, key)}" for k, v in value.items()) + "}"
    raise UserError(f"{SETTING}.{key}: {value!r} is not a JSON value (a string, number, boolean, null, list "
                    "or mapping)")


def read_variables(template: str) -> set[str]:
    """The variables `template` reads from its caller (messages, tools, add_generation_prompt, its switches).

    Jinja's own analysis also reports the names a template sets itself wherever it cannot prove the set
    comes first (a ``content`` set in both branches of an ``if``, then read). Here a name is the caller's
    where some read of it is not preceded by a set on every path (``set messages = messages[1:]``; a
    ``developer_preamble`` set only if there is a system message), or where the template asks whether it
    is defined (a switch with a default).
    """
    import jinja2
    from jinja2 import meta, nodes

    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        tree = env.parse(_GENERATION_TAGS.sub("", template))
    except jinja2.TemplateSyntaxError as err:
        raise UserError(f"{SETTING}: the chat template does not parse ({err})") from None
    callers: set[str] = set()

    def names(target) -> set[str]:
        return {n.name for n in target.find_all(nodes.Name)} | ({target.name} if isinstance(target, nodes.Name) else set())

    def reads(node, bound: set[str]) -> None:  # an expression: what it reads that is not yet set
        for n in [node, *node.find_all(nodes.Name)] if isinstance(node, nodes.Node) else []:
            if isinstance(n, nodes.Name) and n.ctx == "load" and n.name not in bound:
                callers.add(n.name)
            if isinstance(n, nodes.Test) and n.name == "defined" and isinstance(n.node, nodes.Name):
                callers.add(n.node.name)

    def block(body: list, bound: set[str]) -> set[str]:
        """Walks the statements `body` with `bound` set on entry; the names set on every path through it."""
        bound = set(bound)
        for node in body:
            if isinstance(node, nodes.Assign):
                reads(node.node, bound)
                bound |= names(node.target)
            elif isinstance(node, nodes.AssignBlock):
                block(node.body, bound)
                bound |= names(node.target)
            elif isinstance(node, nodes.If):
                reads(node.test, bound)
                paths = [block(node.body, bound)]
                for elif_ in node.elif_:
                    reads(elif_.test, bound)
                    paths.append(block(elif_.body, bound))
                paths.append(block(node.else_, bound))
                bound = set.intersection(*paths)
            elif isinstance(node, nodes.For):
                reads(node.iter, bound)
                inner = bound | names(node.target) | {"loop"}
                if node.test is not None:
                    reads(node.test, inner)
                block(node.body, inner)
                block(node.else_, bound)
            elif isinstance(node, (nodes.Macro, nodes.CallBlock)):
                own = {a.name for a in node.args} | {"caller", "varargs", "kwargs"}
                if isinstance(node, nodes.CallBlock):
                    reads(node.call, bound)
                block(node.body, bound | own)
                if isinstance(node, nodes.Macro):
                    bound.add(node.name)
            elif isinstance(node, nodes.Stmt) and hasattr(node, "body"):  # with, filter blocks, scopes
                for field in node.fields:
                    if field != "body":
                        value = getattr(node, field)
                        for child in value if isinstance(value, list) else [value]:
                            reads(child, bound)
                block(node.body, bound | {n for t in getattr(node, "targets", []) for n in names(t)})
            else:
                reads(node, bound)
        return bound

    block(tree.body, set())
    return set(meta.find_undeclared_variables(tree)) & callers


def with_defaults(template: str, kwargs: dict, *, where: str) -> str:
    """`template` with each of `kwargs` set as its default at its head; `where` names the template in errors."""
    if not kwargs:
        return template
    if not isinstance(kwargs, dict):
        raise UserError(f"{SETTING} must be a mapping of a template variable to its value, not {kwargs!r}")
    bad = [k for k in kwargs if not isinstance(k, str) or not _NAME.match(k)]
    if bad:
        raise UserError(f"{SETTING}: {', '.join(map(repr, bad))} cannot name a template variable")
    read = read_variables(template)
    unread = sorted(set(kwargs) - read)
    if unread:
        switches = sorted(read - {"messages", "tools", "documents", "add_generation_prompt", "bos_token",
                                  "eos_token", "raise_exception", "strftime_now", "tojson", "namespace"})
        raise UserError(f"{SETTING}: {where} reads no variable {', '.join(map(repr, unread))}; "
                        f"the ones it reads besides the messages: {', '.join(switches) or 'none'}")
    head = "".join(f"{{%- set {k} = {k} if {k} is defined else {_literal(v, k)} %}}" for k, v in kwargs.items())
    _check_round_trip(head, kwargs)
    return head + template


def _check_round_trip(head: str, kwargs: dict) -> None:
    """The defaults evaluate to the values given (a literal Jinja reads otherwise would change the run)."""
    import jinja2

    names = list(kwargs)
    probe = head + "{{ [" + ", ".join(names) + "] | tojson }}"
    got = json.loads(jinja2.Environment().from_string(probe).render())
    if got != json.loads(json.dumps([kwargs[k] for k in names])):
        raise UserError(f"{SETTING}: {kwargs!r} do not survive as template literals ({got!r})")
