"""Drafter families: one module per family, and the registry the rest of the package asks.

A *family* is a kind of drafter the package evaluates (DFlash 1, DFlash 2, ...). Everything the package asks
about a drafter's kind is answered here, by the family object, never by testing a name or probing a module
attribute elsewhere (``tests/drafter/test_families.py`` holds the allow-list): its name and label, the
architecture and speculators model type it is saved under, its config fields, what ``strip_drafter`` writes for
it, the proposal path the replay walks, whether DDTree applies, its draft policies at temperature > 0 and the
engine setting of each, its extra ``tau.csv`` columns and report sections. The layout follows vllm-project/
speculators, which gives each drafter family a folder (``src/speculators/models/<family>/``) and a registry.

This module is torch-free at import (``report/`` asks a family about its columns and labels without torch). The
nn.Module code stays in :mod:`dflash_eval.drafter.model` (one file checked against the paper); a family points to
it (:attr:`DrafterFamily.model`) and the module carries its family (``DFlashDrafter.family``), so ``replay/``,
which sits above ``drafter/`` in the layers and must not import it, asks ``drafter.family`` (duck-typed).

Adding a family: docs/drafter-families.md.
"""

from __future__ import annotations

import math
from typing import Any

from dflash_eval.core.errors import InputError
from dflash_eval.drafter.families.base import (
    DRAFT_POLICIES,
    SHARED_FIELDS,
    DrafterFamily,
    Selection,
    WalkContext,
)
from dflash_eval.drafter.families.dflash import DFlash
from dflash_eval.drafter.families.dflash2 import DFlash2
from dflash_eval.drafter.families.lilicorr import LiLiCorr

#: the registry: family name -> family (each family module has its registry line at the bottom of this file)
FAMILIES: dict[str, DrafterFamily] = {}
#: the family of a config that no other family claims, and of an evaluate output without ``variant``
DEFAULT = "dflash"


def register(family: DrafterFamily) -> DrafterFamily:
    """Add ``family`` to :data:`FAMILIES` under its name.

    Raises:
        ValueError: a name already taken or empty."""
    if not family.name or family.name in FAMILIES:
        raise ValueError(f"drafter family name {family.name!r} is empty or taken ({sorted(FAMILIES)})")
    FAMILIES[family.name] = family
    return family


def family_of(cfg_or_name: Any) -> DrafterFamily:
    """The family of a name (a ``variant`` value; None or NaN: :data:`DEFAULT`), of a drafter config (anything with a
    ``variant`` attribute: :class:`dflash_eval.drafter.config.DrafterConfig`), of a drafter (its ``family``) or of a
    family itself.

    Raises:
        KeyError: an unknown name (listing the known ones)."""
    if isinstance(cfg_or_name, DrafterFamily):
        return cfg_or_name
    fam = getattr(cfg_or_name, "family", None)
    if isinstance(fam, DrafterFamily):
        return fam
    name = getattr(cfg_or_name, "variant", cfg_or_name)
    if name is None or (isinstance(name, float) and math.isnan(name)):
        name = DEFAULT
    if name not in FAMILIES:
        raise KeyError(f"unknown drafter family {name!r} (known: {sorted(FAMILIES)})")
    return FAMILIES[name]


def family_of_config(cfg: dict, dcfg: dict | None = None, source=None) -> DrafterFamily:
    """The family a drafter ``config.json`` dict is of: the one non-default family its ``architectures`` names, else
    the one non-default family that claims it by its fields (:meth:`DrafterFamily.claims`), else :data:`DEFAULT`;
    ``dcfg``: its ``dflash_config`` (default: read from ``cfg``), ``source``: the file named in errors.

    Raises:
        InputError: no architecture decides and more than one family claims it (their fields are mixed)."""
    dcfg = cfg.get("dflash_config") or {} if dcfg is None else dcfg
    archs = cfg.get("architectures") or []
    named = [f for n, f in FAMILIES.items() if n != DEFAULT and f.architecture in archs]
    if len(named) == 1:
        return named[0]
    claims = [f for n, f in FAMILIES.items() if n != DEFAULT and f.claims(cfg, dcfg)]
    if len(claims) > 1:
        raise InputError(source, "dflash_config", f"the fields of several drafter families are set: "
                         f"{[f.name for f in claims]}", "keep the fields of the drafter's own family")
    return claims[0] if claims else FAMILIES[DEFAULT]


def family_of_architecture(name: str | None) -> DrafterFamily | None:
    """The family saved under a ``config.json`` ``architectures`` entry, or None."""
    return next((f for f in FAMILIES.values() if f.architecture == name), None)


def family_of_speculators(model_type: str | None) -> DrafterFamily | None:
    """The family of a speculators ``speculators_model_type``, or None."""
    return next((f for f in FAMILIES.values() if f.speculators_model_type == model_type), None)


def ordered(names) -> list:
    """``names`` (family names, e.g. a frame's ``variant`` values) in report order: known families by
    :attr:`DrafterFamily.order`, then unknown names by name."""
    return sorted(names, key=lambda n: (n not in FAMILIES, FAMILIES[n].order if n in FAMILIES else 0, str(n)))


def label(name) -> str:
    """The report label of a family name ("DFlash 1"); an unknown name: itself."""
    return FAMILIES[name].label if name in FAMILIES else str(name)


__all__ = [
    "DEFAULT",
    "DFLASH",
    "DFLASH2",
    "DRAFT_POLICIES",
    "FAMILIES",
    "LILICORR",
    "SHARED_FIELDS",
    "DrafterFamily",
    "Selection",
    "WalkContext",
    "family_of",
    "family_of_architecture",
    "family_of_config",
    "family_of_speculators",
    "label",
    "ordered",
    "register",
]

# the registry lines: one per family module
DFLASH = register(DFlash())
DFLASH2 = register(DFlash2())
LILICORR = register(LiLiCorr())
