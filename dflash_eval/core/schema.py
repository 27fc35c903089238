"""The config schema (``schemas/config.schema.yaml``): the single source of truth for options.

Snakemake validates workflow configs against it (``rules/common.smk``, which
fills in the schema defaults) and the CLI reads its option defaults from it
through :func:`schema_default`, so a default lives in exactly one place.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from dflash_eval.core.yaml_strict import load_file

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "schemas" / "config.schema.yaml"


@functools.lru_cache(maxsize=1)
def load_schema() -> dict:
    """The parsed JSON schema (dict); a key written twice in it is an error (:mod:`dflash_eval.core.yaml_strict`)."""
    return load_file(SCHEMA_PATH)


def schema_property(dotted: str) -> dict:
    """The schema node of a property, e.g. ``schema_property("evaluate.max_samples")["minimum"] == 0``.

    Raises:
        KeyError: the property does not exist (a bug, not user input).
    """
    node = load_schema()
    for part in dotted.split("."):
        node = node.get("items", node)  # a list's entries: "checkpoints.demo.step"
        node = node["properties"][part]
    return node


def schema_default(dotted: str) -> Any:
    """Default of a schema property, e.g. ``schema_default("generation.max_new_tokens") == 256``.

    Raises:
        KeyError: the property or its default does not exist (a bug, not user input).
    """
    node = schema_property(dotted)
    if "default" not in node:
        raise KeyError(f"schema property {dotted} has no default")
    return node["default"]


def sampling_label(setting: dict) -> str:
    """Stable short name of a sampling setting dict (``temperature``, ``top_p``, ``top_k``), e.g. ``T0`` or
    ``T1_p0.95_k20``: filters at their defaults are left out. :attr:`dflash_eval.replay.sampling.SamplingSetting.label`
    and the parse-time checks use it (torch-free)."""
    t = float(setting.get("temperature", 0))
    if t == 0:
        return "T0"
    parts = [f"T{t:g}"]
    if float(setting.get("top_p", 1.0)) < 1:
        parts.append(f"p{float(setting['top_p']):g}")
    if int(setting.get("top_k", 0) or 0):
        parts.append(f"k{int(setting['top_k'])}")
    return "_".join(parts)
