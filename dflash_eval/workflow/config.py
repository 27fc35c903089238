"""Parse-time checks of a workflow config against the schema (:mod:`dflash_eval.core.schema`): readable
validation errors and integral numbers (torch-free; called from ``rules/common.smk``)."""

from __future__ import annotations

import difflib
from typing import Any

from dflash_eval.core.schema import load_schema
from dflash_eval.workflow.checkpoints import NAME_RE, name_problem


def describe_validation_error(err) -> tuple[str, str]:
    """``(config entry, problem)`` of a ``jsonschema.ValidationError`` raised for a workflow config.

    The entry is a dotted path with list indices (``checkpoints.list[0].overrides``); the problem is
    jsonschema's message, except for ``oneOf``/``anyOf`` failures, whose bare message ("... is not
    valid under any of the given schemas") says nothing: they read the ``description`` of the schema
    node that failed, which for such nodes states the rule (e.g. "set either random_init: true or
    drafter (exactly one)"); a name that fails the name pattern (:data:`dflash_eval.workflow.checkpoints.NAME_RE`)
    reads what a name may hold.
    """
    if not hasattr(err, "absolute_path"):  # not a jsonschema error: keep its text
        return "(config)", str(err)
    # jsonschema's best_match descends into one alternative of a oneOf ("False was expected"); the
    # alternative means nothing to the user, the rule of the oneOf does
    node = err
    while node.parent is not None:
        node = node.parent
        if node.validator in ("oneOf", "anyOf") and isinstance(node.schema, dict) and node.schema.get("description"):
            err = node
    path = ""
    for part in err.absolute_path:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    problem = err.message
    if err.validator in ("oneOf", "anyOf") and isinstance(err.schema, dict) and err.schema.get("description"):
        problem = f"not one of the allowed forms: {err.schema['description']}"
    elif err.validator == "pattern" and isinstance(err.instance, str) and err.schema.get("pattern") in (
            NAME_RE.pattern, "^$|" + NAME_RE.pattern):  # a name, or '' for a default
        problem = f"{err.instance!r}: a name becomes a folder or file name, so it {name_problem(err.instance)}"
    elif err.validator == "additionalProperties" and isinstance(err.instance, dict) and isinstance(err.schema, dict):
        known = list(err.schema.get("properties", {}))
        for key in sorted(set(err.instance) - set(known)):  # a misspelt option: name the closest known one
            close = difflib.get_close_matches(key, known, n=3)
            if close:
                problem += f"; the closest known option to {key!r} is {close[0]!r}"
                if len(close) > 1:
                    problem += f" (or {' / '.join(repr(c) for c in close[1:])})"
    return path or "(top level)", problem



def integral_numbers(config: Any, node: dict | None = None) -> Any:
    """``config`` with each float the schema types ``integer`` (JSON Schema accepts ``4.0`` there) made an int, in
    place (dicts and lists), and returned: ``n: 4.0`` and ``n: 4`` are one setting, so they give the same options
    record and rerun nothing."""
    node = load_schema() if node is None else node
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if isinstance(config, float) and "integer" in kinds and "number" not in kinds and config.is_integer():
        return int(config)
    if isinstance(config, dict):
        props, other = node.get("properties", {}), node.get("additionalProperties")
        for key, value in config.items():
            sub = props.get(key, other if isinstance(other, dict) else None)
            if sub is not None:
                config[key] = integral_numbers(value, sub)
    elif isinstance(config, list) and isinstance(node.get("items"), dict):
        for i, value in enumerate(config):
            config[i] = integral_numbers(value, node["items"])
    return config
