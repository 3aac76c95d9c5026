"""Checks of the workflow config (config/config.yaml) that run when the Snakefile loads.

Each returns every problem it finds, each naming the config key (and the path
or value at fault), so a user fixes them all in one go instead of meeting them
one rule at a time (a missing data file used to surface as Snakemake's
`MissingInputException` on a path, without the key that named it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from pipeline.storage import globs, hub, hub_data

EMBEDDED = "embedded"
# The embedded defaults a `model` (or a data split) may name, each built by `prepare_base` into
# results/<name>/ (model/, data/), and the kind `prepare-base --kind` builds.
EMBEDDED_KINDS = {EMBEDDED: "text", "embedded-vlm": "vlm"}
# What a `datasets` save_to_disk dir holds beside its shards (a DatasetDict: dataset_dict.json), the
# one kind of dataset that is a directory (pipeline/data/readers.py reads it, and names a wrong one).
SAVED_DATASET_FILES = ("state.json", "dataset_info.json", "dataset_dict.json")


def schema_problems(config: dict, schema_path: Path, command_line: Mapping | None = None) -> list[str]:
    """Every key of `config` the JSON schema rejects: unknown keys, wrong types, bad values; those
    `command_line` (snakemake's `--config` values) set end in "(from --config)"."""
    import jsonschema
    import yaml

    schema = yaml.safe_load(Path(schema_path).read_text())
    validator = jsonschema.Draft202012Validator(schema)
    given = _leaves(command_line) if command_line else set()
    problems = []
    for error in sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.absolute_path))):
        path = tuple(map(str, error.absolute_path))
        key = ".".join(path)
        if error.validator == "additionalProperties":
            known = sorted(error.schema.get("properties", {}))
            for name in sorted(set(error.instance) - set(known)):
                where = " (from --config)" if _given(given, (*path, name)) else ""
                problems.append(f"{key + '.' if key else ''}{name}: unknown key (known here: {', '.join(known)}){where}")
        else:
            where = " (from --config)" if _given(given, path) else ""
            problems.append(f"{key or '(top level)'}: {error.message}{where}")
    return problems


def fill_defaults(config: dict, schema_path: Path) -> None:
    """Give every key the JSON schema has a default for, and `config` leaves out, that default, in
    place (what Snakemake's `validate` does). `config` has passed `schema_problems`."""
    import jsonschema
    import yaml

    schema = yaml.safe_load(Path(schema_path).read_text())
    check_properties = jsonschema.Draft202012Validator.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, here):
        if isinstance(instance, dict):
            for name, spec in properties.items():
                if "default" in spec:
                    instance.setdefault(name, spec["default"])
        yield from check_properties(validator, properties, instance, here)

    filling = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"properties": set_defaults})
    filling(schema).validate(config)


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


def _leaves(tree, path: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    if isinstance(tree, Mapping) and tree:
        return set().union(*(_leaves(value, (*path, str(key))) for key, value in tree.items()))
    return {path}


def _given(leaves: set[tuple[str, ...]], path: tuple[str, ...]) -> bool:
    """Whether --config set the value at `path` (or a value inside it, or the list holding it)."""
    return any(leaf[:len(path)] == path or path[:len(leaf)] == leaf for leaf in leaves)


def _types(schema: Mapping | None) -> set[str] | None:
    if not schema or "type" not in schema:
        return None
    kind = schema["type"]
    return {kind} if isinstance(kind, str) else set(kind)


def _child(schema: Mapping | None, key) -> Mapping | None:
    """The schema of `key` inside the object (or array) `schema` describes."""
    if not schema:
        return None
    if isinstance(key, int):
        return schema.get("items")
    properties = schema.get("properties", {})
    if key in properties:
        return properties[key]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, Mapping) else None


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "other")


def _typed_leaf(text: str, types: set[str] | None):
    """A `--config` leaf as a config file would give it, where the schema wants that type.

    Snakemake reads a nested `--config` value with YAML's BaseLoader: every leaf a string
    ('40', 'true', 'null'). A config file's YAML gives 40, True, None. Where the schema names
    the types, the string becomes the YAML value only when the schema accepts that value's type
    (so `data.train: 123` stays the file name '123', `schedule.total_updates: 40` becomes 40,
    `data.val: null` becomes None); where it names none (a sweep grid's values), the YAML value.
    A string no type accepts is left as it is, for the schema check to name.
    """
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and types and "number" in types:
        try:
            value = float(text)  # YAML 1.1 reads 1e-3 as a string; JSON Schema's number does not
        except ValueError:
            pass
    if types is None:
        return value if not isinstance(value, (dict, list)) else text
    kind = _json_type(value)
    accepted = kind in types or (kind == "integer" and "number" in types)
    return value if accepted and kind != "string" else text


def type_command_line(config: dict, command_line: Mapping, schema_path: Path) -> None:
    """Give the values `--config` set inside nested keys (`schedule={total_updates: 40}`) the
    types a config file would give them (`_typed_leaf`), in `config`, in place.

    Top-level `--config key=value` values are typed by snakemake already (int, float, True/False).
    The schema check after this stays as strict as for a config file.
    """
    import yaml

    schema = yaml.safe_load(Path(schema_path).read_text())

    def walk(given, target, schema_here):
        items = given.items() if isinstance(given, Mapping) else enumerate(given)
        for key, value in items:
            sub = _child(schema_here, key)
            if isinstance(value, (Mapping, list)) and isinstance(target, (dict, list)):
                walk(value, target[key], sub)
            elif isinstance(value, str):
                target[key] = _typed_leaf(value, _types(sub))

    for key, value in command_line.items():
        if isinstance(value, (Mapping, list)) and key in config:
            walk(value, config[key], _child(schema, key))


def sources(configfiles: list, command_line: Mapping) -> str:
    """Where the workflow config came from, for error messages: config/config.yaml, each
    --configfile, and --config when it set anything."""
    names = ["config/config.yaml"] + [_relative(f) for f in configfiles if _relative(f) != "config/config.yaml"]
    return ", ".join(names + (["--config " + " ".join(sorted(command_line))] if command_line else []))


def _relative(path) -> str:
    path = Path(path)
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(path)


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
            page = re.match(r"https://(?:huggingface|hf)\.co/([\w.-]+/[\w.-]+)(?:/tree/([^/?#]+))?/?$", model)
            if page:  # a model's page copied from the browser
                problems.append(f"model: {model} is a web page; give the model's hub id: "
                                f"{page[1]}{'@' + page[2] if page[2] else ''}")
            else:
                problems.append(f"model: {model} does not exist (and is not a hub id like org/name or "
                                "org/name@revision)")
    data = config.get("data") or {}
    named = [(f"data.{split}", data.get(split)) for split in ("train", "val", "test")]
    if isinstance(data.get("train"), list):
        named[0:1] = [(f"data.train[{i}].path", entry.get("path")) for i, entry in enumerate(data["train"])]
    for key, value in named:
        if value is None or value in EMBEDDED_KINDS:
            continue
        if hub_data.is_url(value):
            problems += _hub_data_problems(key, value)
            continue
        path = Path(value).expanduser()
        if globs.is_glob(value):
            if not globs.matches(value):
                problems.append(f"{key}: {value} is a glob that matches no file")
        elif not path.exists():
            repo = hub.parse(value) and value.count("/") == 1 and not hub_data.looks_like_file(value)  # org/name
            hint = (f" (a hub dataset is given by URL: hf://datasets/{value} for its split of {key}, or a file or "
                    f"glob in it, e.g. hf://datasets/{value}/data/train-*.parquet)") if repo else ""
            problems.append(f"{key}: {value} does not exist{hint}")
        elif path.is_dir() and not any((path / name).is_file() for name in SAVED_DATASET_FILES) and not any(
                p.is_file() and not p.name.startswith(".") for p in path.rglob("*")):
            # a directory of data files is read as one dataset; which of its files are data, validation says
            problems.append(f"{key}: {value} is an empty directory: give a dataset file, a directory of data files "
                            f"or a `datasets` save_to_disk dir ({' / '.join(SAVED_DATASET_FILES)})")
        elif not path.is_file() and not path.is_dir():
            problems.append(f"{key}: {value} is neither a dataset file nor a directory")
    image_dirs = [("data.image_dir", data.get("image_dir"))]
    if isinstance(data.get("train"), list):
        image_dirs += [(f"data.train[{i}].image_dir", entry.get("image_dir")) for i, entry in enumerate(data["train"])]
    problems += [f"{key}: {value} is not a directory (the one the data's relative image paths start from)"
                 for key, value in image_dirs if value and not Path(value).expanduser().is_dir()]
    return problems + train_set_problems(data)


def _hub_data_problems(key: str, value: str) -> list[str]:
    """A dataset given by hub URL: a malformed URL; offline, files the cache does not hold (the workflow
    stops as it loads, not in `fetch_data`)."""
    files = hub_data.parse(value)
    if files is None:
        return [hub_data.url_problem(key, value)]
    if hub.offline() and (hub_data.cached_listing(files) if files.pattern is None else hub_data.cached(files)) is None:
        return [f"{key}: {hub_data.not_cached_message(files)}"]
    return []


def train_sets(data: Mapping) -> dict[str, dict] | None:
    """data.train as several datasets (a list): name -> {path, weight, records, columns, roles, image_dir}, in
    the config's order; None for one dataset (a path). A dataset's columns / roles are data.columns /
    data.roles with its own on top, its image_dir its own else data.image_dir. Its name defaults to
    `default_name(path)`."""
    entries = data.get("train")
    if not isinstance(entries, list):
        return None
    out = {}
    for entry in entries:
        out[entry.get("name") or default_name(entry["path"])] = {
            "path": entry["path"], "weight": entry.get("weight"), "records": entry.get("records"),
            "columns": {**(data.get("columns") or {}), **(entry.get("columns") or {})},
            "roles": {**(data.get("roles") or {}), **(entry.get("roles") or {})},
            "image_dir": entry.get("image_dir") or data.get("image_dir"),
        }
    return out


def default_name(path: str) -> str:
    """A training dataset's name when the config gives none: its file name without the extension (a dir's
    whole name, a hub URL's dataset name, with the subset and split a viewer address names; a glob's file name
    up to its first glob character, else its directory's), in letters, digits and . _ - (the name is a directory
    and a Snakemake wildcard value)."""
    files = hub_data.parse(path) if hub_data.is_url(path) else None
    name = files.repo_id.split("/")[1] if files else Path(str(path).rstrip("/")).name
    if files and (files.subset or files.split):  # the dataset viewer's address of a split: ultrachat_200k-train_sft
        name = "-".join([name, *[part for part in (files.subset, files.split) if part not in (None, "default")]])
    stem = name if files or Path(path).is_dir() else Path(name).stem
    if files is None and globs.is_glob(path):  # data/train-*.parquet: train; shards/*/*.jsonl: shards
        stem = re.split(r"[*?\[]", name)[0].rstrip("-_.") or globs.root(path).resolve().name
    return re.sub(r"[^A-Za-z0-9._-]", "_", stem).lstrip("._-") or "dataset"


def train_set_problems(data: Mapping) -> list[str]:
    """Several training datasets: names that repeat, a dataset with both a weight and records."""
    entries = data.get("train")
    if not isinstance(entries, list):
        return []
    problems, seen = [], {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or "path" not in entry:
            continue  # the schema check names it
        name = entry.get("name") or default_name(entry["path"])
        if name in seen:
            problems.append(f"data.train[{i}]: dataset name {name!r} is also data.train[{seen[name]}]'s "
                            "(names default to the file name): give each a distinct `name:`")
        seen.setdefault(name, i)
        if entry.get("weight") is not None and entry.get("records") is not None:
            problems.append(f"data.train[{i}] ({name}): give a weight or records, not both")
    return problems
