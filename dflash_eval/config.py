"""The config schema (``schemas/config.schema.yaml``): the single source of truth for options.

Snakemake validates workflow configs against it (``rules/common.smk``, which
fills in the schema defaults) and the CLI reads its option defaults from it
through :func:`schema_default`, so a default lives in exactly one place.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml

SCHEMA_PATH = Path(__file__).with_name("schemas") / "config.schema.yaml"


@functools.lru_cache(maxsize=1)
def load_schema() -> dict:
    """The parsed JSON schema (dict)."""
    return yaml.safe_load(SCHEMA_PATH.read_text())


def schema_default(dotted: str) -> Any:
    """Default of a schema property, e.g. ``schema_default("generation.max_new_tokens") == 256``.

    Raises:
        KeyError: the property or its default does not exist (a bug, not user input).
    """
    node = load_schema()
    for part in dotted.split("."):
        node = node["properties"][part]
    if "default" not in node:
        raise KeyError(f"schema property {dotted} has no default")
    return node["default"]

