"""Checks of the workflow config (config/config.yaml) that run when the Snakefile loads.

Each returns every problem it finds, each naming the config key (and the path
or value at fault), so a user fixes them all in one go instead of meeting them
one rule at a time (a missing data file used to surface as Snakemake's
`MissingInputException` on a path, without the key that named it).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.storage import hub

EMBEDDED = "embedded"
# The embedded defaults a `model` (or a data split) may name, each built by `prepare_base` into
# results/<name>/ (model/, data/), and the kind `prepare-base --kind` builds.
EMBEDDED_KINDS = {EMBEDDED: "text", "embedded-vlm": "vlm"}


def schema_problems(config: dict, schema_path: Path) -> list[str]:
    """Every key of `config` the JSON schema rejects: unknown keys, wrong types, bad values."""
    import jsonschema
    import yaml

    schema = yaml.safe_load(Path(schema_path).read_text())
    validator = jsonschema.Draft202012Validator(schema)
    problems = []
    for error in sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.absolute_path))):
        key = ".".join(map(str, error.absolute_path))
        if error.validator == "additionalProperties":
            known = sorted(error.schema.get("properties", {}))
            for name in sorted(set(error.instance) - set(known)):
                problems.append(f"{key + '.' if key else ''}{name}: unknown key (known here: {', '.join(known)})")
        else:
            problems.append(f"{key or '(top level)'}: {error.message}")
    return problems


def schema_defaults(schema: dict, prefix: str = "") -> dict[str, object]:
    """Dotted key -> default of every leaf the JSON schema gives a default (objects are walked)."""
    out = {}
    for name, spec in (schema.get("properties") or {}).items():
        if spec.get("type") == "object" and "properties" in spec:
            out.update(schema_defaults(spec, f"{prefix}{name}."))
        elif "default" in spec:
            out[prefix + name] = spec["default"]
    return out


def default_differences(config: dict, schema_path: Path) -> dict[str, str]:
    """Dotted key -> what is off, for each schema default that `config` leaves out or sets to
    another value: the shipped config/config.yaml states every default as the schema has it."""
    import yaml

    out = {}
    for key, default in schema_defaults(yaml.safe_load(Path(schema_path).read_text())).items():
        node, found = config, True
        for part in key.split("."):
            found = isinstance(node, dict) and part in node
            node = node[part] if found else None
        if not found:
            out[key] = f"missing (the schema's default: {default!r})"
        elif node != default or isinstance(node, bool) != isinstance(default, bool):
            out[key] = f"{node!r}, the schema's default is {default!r}"
    return out


def path_problems(config: dict) -> list[str]:
    """The model and dataset paths the config names: each must exist and be what it claims to be."""
    problems = []
    model = config.get("model", EMBEDDED)
    if model not in EMBEDDED_KINDS:
        path = Path(model).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                problems.append(f"model: {model} is a directory but not a Hugging Face model (no config.json)")
        elif path.exists():
            problems.append(f"model: {model} is a file; give a Hugging Face model directory or a hub id")
        elif model.startswith((".", "/", "~")) or hub.parse(model) is None:
            problems.append(f"model: {model} does not exist (and is not a hub id like org/name or org/name@revision)")
    for split in ("train", "val", "test"):
        value = (config.get("data") or {}).get(split)
        if value is None or value in EMBEDDED_KINDS:
            continue
        path = Path(value).expanduser()
        if not path.exists():
            problems.append(f"data.{split}: {value} does not exist")
        elif not path.is_file():
            problems.append(f"data.{split}: {value} is not a file (a JSON or JSONL dataset)")
    return problems
