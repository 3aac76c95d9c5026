"""The trainer settings' reference YAML, generated from the dataclasses, and the check of
config/train's group files against them.

The dataclasses in pipeline/config.py state each setting's default and doc once. What a user
reads, docs/train_config.yaml, is written from them by

    python -m pipeline train-config-reference --out docs/train_config.yaml

and tests/test_config_reference.py fails while the committed file differs (a default changed
in a dataclass, a doc edited) until it is regenerated. The same test holds the group files to
"only what they change": a group's default option sets nothing (a value there would be a second
default, free to drift from the dataclass), and another option (lora=full) does not restate a
default unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
import typing
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from pipeline import config as train_config
from pipeline.errors import UserError

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "config" / "train"
REFERENCE = REPO / "docs" / "train_config.yaml"
COMMAND = "python -m pipeline train-config-reference --out docs/train_config.yaml"
WIDTH = 100

HEADER = f"""\
# Every trainer setting with its default and what it does. GENERATED from the dataclasses in
# pipeline/config.py by `{COMMAND}`:
# edit those, not this file (tests/test_config_reference.py fails until it is regenerated).
#
# Change a setting with a Hydra override in config/config.yaml's train.overrides
# (optim.lr=1e-3, validation.every=50), or select another option of a group (lora=full,
# distributed=fsdp: config/train/<group>/<option>.yaml, each holding only what it changes).
# The keys marked ??? are filled in by the workflow.
"""


def defaults(cls: type) -> list[tuple[str, Any, dataclasses.Field]]:
    """(name, default, field) of each setting of a dataclass, read from its fields (a nested
    group's default is its dataclass)."""
    out = []
    for f in dataclasses.fields(cls):
        value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append((f.name, value, f))
    return out


def reference(config_dir: Path = CONFIG_DIR) -> str:
    """The reference YAML text: top-level settings, then each group with its options."""
    hints = typing.get_type_hints(train_config.TrainConfig)
    lines = [HEADER]
    for name, value, f in defaults(train_config.TrainConfig):
        if not dataclasses.is_dataclass(hints[name]):
            lines += _setting(name, value, f, hints[name], "")
    for name, value, f in defaults(train_config.TrainConfig):
        group = hints[name]
        if not dataclasses.is_dataclass(group):
            continue
        lines.append("")
        lines += _comment(" ".join(group.__doc__.split()), "")
        options = sorted(p.stem for p in (Path(config_dir) / name).glob("*.yaml"))
        if len(options) > 1:
            lines += _comment(f"Options (config/train/{name}/): {', '.join(options)}.", "")
        lines.append(f"{name}:")
        group_hints = typing.get_type_hints(group)
        for key, default, field in defaults(group):
            lines += _setting(key, default, field, group_hints[key], "  ")
    return "\n".join(lines) + "\n"


def _setting(name: str, value: Any, field: dataclasses.Field, kind: Any, indent: str) -> list[str]:
    doc = field.metadata.get("doc")
    if not doc:
        raise UserError(f"trainer setting {name} has no doc: declare it with pipeline.config.setting(default, doc)")
    lines = _comment(doc, indent)
    if isinstance(kind, type) and issubclass(kind, Enum):
        lines.append(f"{indent}# one of: {' | '.join(m.value for m in kind)}")
    return lines + [f"{indent}{name}: {_yaml(value)}"]


def _comment(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent + "# ", subsequent_indent=indent + "# ",
                         break_on_hyphens=False)


def _yaml(value: Any) -> str:
    """A default as YAML reads it back: flow lists, 1.0e-08, 'on' quoted (a bare on is a boolean)."""
    value = [_enum_value(v) for v in value] if isinstance(value, list) else _enum_value(value)
    return yaml.safe_dump(value, default_flow_style=True, width=1000).removesuffix("\n...\n").strip()


def _enum_value(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


# --- the group files hold only what they change -------------------------------------------------


def group_problems(config_dir: Path = CONFIG_DIR, name: str = "config") -> list[str]:
    """Every group file of a trainer config tree that states a default: a value in a group's
    default option (or at the top of `name`.yaml), or a non-default option restating a default
    unchanged; and keys or groups the dataclasses do not have. Each names the file and the key."""
    config_dir = Path(config_dir)
    root = config_dir / f"{name}.yaml"
    top = yaml.safe_load(root.read_text()) or {}
    chosen = {k: v for entry in top.get("defaults", []) if isinstance(entry, dict) for k, v in entry.items()}
    problems = _file_problems(root, {k: v for k, v in top.items() if k != "defaults"}, train_config.TrainConfig,
                              default_option=True)
    hints = typing.get_type_hints(train_config.TrainConfig)
    for group_dir in sorted(p for p in config_dir.iterdir() if p.is_dir()):
        group = hints.get(group_dir.name)
        if not dataclasses.is_dataclass(group):
            new = train_config.renamed(group_dir.name)
            problems.append(f"{group_dir}/: no trainer group {group_dir.name!r}"
                            + (f" (renamed: {new})" if new else ""))
            continue
        for path in sorted(group_dir.glob("*.yaml")):
            values = yaml.safe_load(path.read_text()) or {}
            problems += _file_problems(path, values, group, default_option=chosen.get(group_dir.name) == path.stem)
    return problems


def _file_problems(path: Path, values: dict, cls: type, *, default_option: bool) -> list[str]:
    known = {name: (default, field) for name, default, field in defaults(cls)}
    hints = typing.get_type_hints(cls)
    problems = []
    for key, value in values.items():
        if key not in known or dataclasses.is_dataclass(hints[key]):
            problems.append(f"{path}: {key} is not a setting of {cls.__name__} (pipeline/config.py)")
            continue
        default = known[key][0]
        same = _same(value, default, hints[key])
        where = f"{cls.__name__}.{key} in pipeline/config.py"
        if default_option and same:
            problems.append(f"{path}: {key}: {_yaml(value)} restates the default ({where}): remove it")
        elif default_option:
            problems.append(f"{path}: {key}: {_yaml(value)} differs from the default {_yaml(default)} ({where}): "
                            "a default option sets nothing; change the default there (then regenerate the "
                            f"reference: {COMMAND}) or move the value to another option or an override")
        elif same:
            problems.append(f"{path}: {key}: {_yaml(value)} restates the default ({where}) unchanged: an option "
                            "holds only what it changes")
    return problems


def _same(value: Any, default: Any, kind: Any) -> bool:
    if kind is train_config.Switch and isinstance(value, bool):
        value = "on" if value else "off"  # YAML's reading of a bare on / off
    if isinstance(default, list) and isinstance(value, list):
        return len(value) == len(default) and all(_same(v, d, None) for v, d in zip(value, default))
    return _enum_value(value) == _enum_value(default) and isinstance(value, bool) == isinstance(default, bool)


# --- CLI ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline train-config-reference",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="where to write it (the committed one: docs/train_config.yaml)")
    ap.add_argument("--config-dir", type=Path, default=CONFIG_DIR, help="the trainer config tree (its group options)")
    ap.add_argument("--check", action="store_true",
                    help="write nothing: fail when --out differs from the generated text or a group file states a default")
    args = ap.parse_args(argv)
    text = reference(args.config_dir)
    if not args.check:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        return 0
    problems = group_problems(args.config_dir)
    if not args.out.is_file() or args.out.read_text() != text:
        problems.append(f"{args.out} is not what the dataclasses generate: run `{COMMAND}`")
    if problems:
        raise UserError("\n  ".join(["the trainer settings are stated twice or out of date:", *problems]))
    return 0
