"""Stage options: the config schema is the one definition of every option a stage reads.

A stage names the schema entries it reads in :data:`STAGE_OPTIONS` (a whole section such as
``evaluate``, or one property such as ``target.training_backend``). From that list come:

* the stage's **typed options object** (:func:`make`, :func:`from_args`): a frozen dataclass whose
  fields are those properties, with the schema's defaults (nested objects such as
  ``generation.vllm`` become nested dataclasses: ``opts.vllm.python``);
* its **CLI flags** (:func:`add_flags`): ``--<property>`` (``_`` -> ``-``; a nested object's
  properties as ``--<object>-<property>``), help from the schema's ``description``, values checked
  against the schema (its ``minimum``, ``enum``, item types ...) by jsonschema;
* the **flags a rule passes** (:func:`to_flags`, called through
  :meth:`dflash_eval.workflow.plan.Plan.stage_flags`): the validated config's values rendered as those flags.

Adding an option is therefore the schema entry plus the code that uses it. Two schema
annotations steer this:

* ``x-plan: true``: read by the workflow plan at parse time (which prompt set, which checkpoints,
  whether a rule runs, the cached layers, a secret), never by the stage: no field, no flag;
* ``x-rerun: false``: cannot change a stage's outputs (timeouts, retries, requests in flight). The
  workflow hands these to the jobs through the environment variable :data:`RUNTIME_ENV` (set by
  the rules' shell prefix, which is no rerun trigger), not as a rule's ``params``, so editing one
  reruns nothing; an explicit flag still wins.
* ``x-flag-unless-default: true``: left out of the flags while at its default (the stage's parser has the
  same default), so an option added to an existing stage reruns no job of a run that does not set it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
from typing import Any

from dflash_eval.core.errors import InputError
from dflash_eval.core.schema import load_schema

#: schema entries each stage reads (stage = Snakemake rule = ``dflash_eval/stages/<stage>.py``)
STAGE_OPTIONS: dict[str, tuple[str, ...]] = {
    "prompts": ("prompt_set", "generation.enable_thinking"),
    "completions": ("generation", "target.linear_attn_backend", "target.devices", "target.max_memory"),
    "hidden_states": ("cache", "target.linear_attn_backend", "target.devices", "target.max_memory"),
    "evaluate": ("evaluate", "target.training_backend"),
    "kernel_parity": ("kernel_parity", "cache.batch_tokens", "cache.device", "cache.dtype", "target.devices",
                      "target.max_memory"),
    "engine_parity": ("engine_parity", "cache", "target.linear_attn_backend", "target.devices", "target.max_memory"),
    "fp8_parity": ("fp8_parity", "cache", "target.linear_attn_backend", "target.devices", "target.max_memory"),
    "validate_online": ("validate_online",),
    "validate_engine": ("validate_engine",),
    "target_costs": ("target_costs", "target.linear_attn_backend", "target.devices", "target.max_memory"),
    "trackers": ("trackers",),
    "summary": ("loops",),
    "reslice": ("reslice",),
}

#: JSON ``{stage: {option path joined by ".": value}}`` of the ``x-rerun: false`` options (:func:`runtime_env`)
RUNTIME_ENV = "DFLASH_EVAL_RUNTIME_OPTIONS"

_JSON_TYPES = {"integer": int, "number": float, "string": str, "boolean": bool, "array": list, "object": dict}


def _node(dotted: str) -> dict:
    node = load_schema()
    for part in dotted.split("."):
        node = node["properties"][part]
    return node


def _is_section(node: dict) -> bool:
    """An object whose properties are options (not a free-form mapping such as ``vllm.env``)."""
    return node.get("type") == "object" and "properties" in node and not isinstance(
        node.get("additionalProperties"), dict)


def _leaves(stage: str) -> list[tuple[tuple[str, ...], str, dict]]:
    """``(field path, schema dotted path, node)`` of every option of ``stage``, in schema order."""
    out = []

    def walk(prefix: tuple[str, ...], dotted: str, node: dict):
        for name, sub in node["properties"].items():
            if sub.get("x-plan"):
                continue
            if _is_section(sub):
                walk(prefix + (name,), f"{dotted}.{name}", sub)
            else:
                out.append((prefix + (name,), f"{dotted}.{name}", sub))

    for entry in STAGE_OPTIONS[stage]:
        node = _node(entry)
        if _is_section(node):
            walk((), entry, node)
        else:
            out.append(((entry.split(".")[-1],), entry, node))
    seen = {}
    for path, dotted, _ in out:
        if path in seen:
            raise KeyError(f"stage {stage}: option {'.'.join(path)} comes from both {seen[path]} and {dotted}")
        seen[path] = dotted
    return out


def flag_name(path: tuple[str, ...]) -> str:
    """``("vllm", "max_model_len")`` -> ``--vllm-max-model-len``."""
    return "--" + "-".join(path).replace("_", "-")


def _dest(path: tuple[str, ...]) -> str:
    """argparse dest of an option: its name, nested ones joined by ``__`` (``vllm__python``)."""
    return "__".join(path)


def _python_type(node: dict):
    t = node.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), None)
    if t is None and "enum" in node:
        return str
    return _JSON_TYPES.get(t, object)


@functools.lru_cache(maxsize=None)
def options_class(stage: str) -> type:
    """The frozen dataclass of ``stage``'s options (fields = schema properties, defaults = schema defaults).

    Raises:
        KeyError: ``stage`` is not in :data:`STAGE_OPTIONS`, or two entries give one field name (a bug).
    """
    leaves = _leaves(stage)

    def build(name: str, prefix: tuple[str, ...]) -> type:
        fields, done = [], set()
        for path, dotted, node in leaves:
            if path[: len(prefix)] != prefix or len(path) == len(prefix):
                continue
            head = path[len(prefix)]
            if head in done:
                continue
            done.add(head)
            if len(path) > len(prefix) + 1:  # a nested section
                sub = build(f"{name}_{head}", prefix + (head,))
                fields.append((head, sub, dataclasses.field(default_factory=sub)))
            else:
                default = node.get("default")
                typ = _python_type(node)
                factory = (lambda d=default: json.loads(json.dumps(d))) if isinstance(default, (list, dict)) else None
                fields.append((head, typ, dataclasses.field(default_factory=factory) if factory
                               else dataclasses.field(default=default)))
        cls = dataclasses.make_dataclass(name, fields, frozen=True)
        cls.__doc__ = f"Options of stage {stage!r} (schema entries {', '.join(STAGE_OPTIONS[stage])})."
        return cls

    return build("".join(p.title() for p in stage.split("_")) + "Options", ())


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    tree[path[-1]] = value


def _get(tree: dict, path: tuple[str, ...], default=dataclasses.MISSING):
    for part in path:
        if not isinstance(tree, dict) or part not in tree:
            if default is dataclasses.MISSING:
                raise KeyError(".".join(path))
            return default
        tree = tree[part]
    return tree


def _instantiate(cls: type, values: dict):
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        v = values[f.name]
        kwargs[f.name] = _instantiate(f.type, v) if dataclasses.is_dataclass(f.type) and isinstance(v, dict) else v
    return cls(**kwargs)


def validate(stage: str, values: dict, where: str = "options") -> None:
    """Check ``values`` (a nested dict of ``stage``'s options, as the fields) against the schema.

    Raises:
        InputError: naming the flag and the schema's complaint (e.g. ``--ddtree-budgets: [0] ...``).
    """
    for path, dotted, node in _leaves(stage):
        value = _get(values, path, None)
        if value is None and node.get("default", 0) is not None:
            continue  # not given: the default applies
        if (problem := _schema_problem(value, node)) is not None:
            raise InputError(None, flag_name(path), f"{value!r}: {problem} (schema entry {dotted})",
                             f"give a value the config schema allows for {dotted}: {node.get('description', '')}".rstrip(": "))


def make(stage: str, values: dict | None = None, **overrides):
    """The typed options of ``stage`` from a nested dict (a config section's shape) and keyword overrides.

    Unknown keys are an error (a misspelt option must never be ignored).

    Raises:
        InputError: an unknown option or a value the schema refuses.
    """
    tree = json.loads(json.dumps(values or {}))
    known = {p[0] for p, _, _ in _leaves(stage)}
    for key, value in overrides.items():
        if key not in known:
            raise InputError(None, key, f"not an option of stage {stage} (known: {sorted(known)})",
                             "use one of the known options")
        tree[key] = value
    _check_unknown(stage, tree)
    validate(stage, tree)
    return _instantiate(options_class(stage), tree)


def _check_unknown(stage: str, tree: dict, prefix: tuple[str, ...] = ()) -> None:
    paths = {p for p, _, _ in _leaves(stage)}
    for key, value in tree.items():
        path = prefix + (key,)
        if path in paths:
            continue
        if any(p[: len(path)] == path for p in paths) and isinstance(value, dict):
            _check_unknown(stage, value, path)
            continue
        raise InputError(None, ".".join(path), f"not an option of stage {stage}", "see the config schema")


def section_values(stage: str, config: dict) -> dict:
    """The nested dict of ``stage``'s options read from a validated workflow ``config`` (defaults filled)."""
    tree: dict = {}
    for path, dotted, node in _leaves(stage):
        value = _get(config, tuple(dotted.split(".")), node.get("default"))
        _set(tree, path, value)
    return tree


def schema_type(dotted: str):
    """An argparse ``type`` for a flag mirroring the schema property ``dotted`` (its value checked by the schema),
    e.g. ``schema_type("checkpoints.demo.block_size")`` for a flag that is not a stage option."""
    node = load_schema()
    for part in dotted.split("."):
        node = node.get("items", node)  # a list's entries: "checkpoints.demo.step"
        node = node["properties"][part]
    return functools.partial(_parse_value, node, dotted)


def _parse_value(node: dict, dotted: str, text: str):
    """One flag's text -> value of the schema node's type (JSON for arrays/objects; ``1,2`` for integer arrays),
    checked against the node (argparse then names the flag in its error)."""
    value = _convert(node, text)
    if (problem := _schema_problem(value, node)) is not None:
        raise argparse.ArgumentTypeError(f"{problem} ({dotted} in the config schema)")
    return value


def _schema_problem(value, node: dict) -> str | None:
    """jsonschema's complaint about ``value`` against the schema ``node``; None when it conforms."""
    import jsonschema  # deferred: 0.2 s, and building the parsers (--help) checks no value

    try:
        jsonschema.validate(value, node)
    except jsonschema.ValidationError as err:
        return err.message
    return None


def _convert(node: dict, text: str):
    typ = _python_type(node)
    nullable = isinstance(node.get("type"), list) and "null" in node["type"]
    if nullable and text.lower() in ("null", "none", ""):
        return None
    if typ in (list, dict):
        if typ is list and node.get("items", {}).get("type") == "integer" and not text.lstrip().startswith("["):
            try:  # the comma form of an integer list: "8,16", "8", "" (none)
                return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        try:
            return json.loads(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected JSON ({'a list' if typ is list else 'an object'}), got {text!r}") from None
    try:
        return typ(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {node.get('type')}, got {text!r}") from None


def add_flags(parser: argparse.ArgumentParser, stage: str) -> None:
    """Add one flag per option of ``stage`` (group "options (config schema: ...)"); defaults from the schema."""
    group = parser.add_argument_group(f"options (config schema: {', '.join(STAGE_OPTIONS[stage])})")
    taken = {a.dest for a in parser._actions}
    for path, dotted, node in _leaves(stage):
        if _dest(path) in taken:
            raise KeyError(f"stage {stage}: option {dotted} would shadow the stage argument {_dest(path)!r}")
        desc = " ".join(str(node.get("description", "")).split())
        default = node.get("default")
        help_ = f"{desc} [{dotted}; default {json.dumps(default)}]".strip()
        if node.get("x-rerun") is False:
            default = None  # resolved by from_args: the workflow's environment, else the schema default
            help_ += f" (the workflow passes it in {RUNTIME_ENV}: editing it reruns nothing)"
        typ = _python_type(node)
        if typ in (list, dict):  # the description shows the config file's YAML; the flag parses JSON
            ints = typ is list and node.get("items", {}).get("type") == "integer"
            help_ += " (on the command line: JSON" + (", or comma-separated integers" if ints else "") + ")"
        help_ = help_.replace("%", "%%")  # argparse %-formats help texts ("60 % of free memory")
        if typ is bool:
            group.add_argument(flag_name(path), dest=_dest(path), action=argparse.BooleanOptionalAction,
                               default=default, help=help_)
            continue
        kw: dict[str, Any] = {"choices": node["enum"]} if "enum" in node else {}
        group.add_argument(flag_name(path), dest=_dest(path), default=default, metavar=dotted.split(".")[-1].upper(),
                           type=functools.partial(_parse_value, node, dotted), help=help_, **kw)


def from_args(stage: str, args: argparse.Namespace):
    """The typed options of ``stage`` from parsed flags (:func:`add_flags`; unset flags hold the schema default).

    Raises:
        InputError: a value the schema refuses, naming the flag.
    """
    runtime = json.loads(os.environ.get(RUNTIME_ENV) or "{}").get(stage, {})
    tree: dict = {}
    for path, _, node in _leaves(stage):
        value = getattr(args, _dest(path), None)
        if value is None and node.get("x-rerun") is False:
            value = runtime.get(".".join(path))
        if value is not None:
            _set(tree, path, value)
    validate(stage, tree)
    return _instantiate(options_class(stage), tree)


def runtime_env(config: dict) -> str:
    """The value of :data:`RUNTIME_ENV` for a validated workflow ``config``: every stage's ``x-rerun: false`` options."""
    out = {}
    for stage in STAGE_OPTIONS:
        values = section_values(stage, config)
        picked = {".".join(path): _get(values, path) for path, _, node in _leaves(stage) if node.get("x-rerun") is False}
        if picked:
            out[stage] = picked
    return json.dumps(out, sort_keys=True, separators=(",", ":"))


def _render(node: dict, value) -> str:
    if isinstance(value, (list, dict)):
        if _python_type(node) is list and node.get("items", {}).get("type") == "integer":
            return ",".join(str(int(v)) for v in value)
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    if value is None:
        return "null"
    return str(value)


def to_flags(stage: str, values: dict, rerun: bool | None = None) -> list[str]:
    """Command-line words for ``values`` (a nested dict, :func:`section_values`) as ``stage``'s flags.

    Args:
        rerun: ``True`` only options that can change outputs, ``False`` only the ``x-rerun: false``
            ones, ``None`` all.
    """
    words: list[str] = []
    for path, _, node in _leaves(stage):
        if rerun is not None and bool(node.get("x-rerun", True)) != rerun:
            continue
        value = _get(values, path, node.get("default"))
        if node.get("x-flag-unless-default") and value == node.get("default"):
            continue
        flag = flag_name(path)
        if _python_type(node) is bool:
            words.append(flag if value else "--no-" + flag[2:])
        else:
            words.append(f"{flag}={_render(node, value)}")
    return words
