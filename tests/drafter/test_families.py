"""The drafter families (:mod:`dflash_eval.drafter.families`): what each answers, hand-checked, and the structure
rule that only the families tell a family apart.

The rule (:func:`family_tests`): outside :data:`ALLOWED`, no module of the package tests a family by name or by
attribute. Found by reading the source (AST; docstrings, comments and messages are prose, not tests):

* a comparison with a family name (``variant == "dflash2"``, ``v in ("dflash", "dflash2")``): any non-default family
  name, or the default one (``"dflash"``) where an operand mentions ``variant``;
* a non-default family name as a string value anywhere else (``variant="dflash2"``, ``{"dflash2": ...}``);
* the name ``is_dflash2``;
* a ``getattr`` probe of a family's module part (``getattr(drafter, "candidate_selector", None)``);
* a family's own field or module part read by name (``selector_top_k``, ``.candidate_selector``).

:data:`ALLOWED`, and why: ``drafter/families/`` (the families themselves); ``drafter/model.py`` (the nn.Module,
one file checked against the paper: it builds DFlash 2's conv and selector from the config's fields);
``drafter/train.py`` (the demo trainer: its DFlash 2 flags are the family's fields and its selector loss trains
``drafter.candidate_selector``). Scripts, bench and tests are outside the package and not scanned.
"""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash_eval.core.errors import InputError
from dflash_eval.drafter.families import (
    DEFAULT,
    DFLASH,
    DFLASH2,
    FAMILIES,
    LILICORR,
    family_of,
    family_of_architecture,
    family_of_config,
    family_of_speculators,
    label,
    ordered,
)

ROOT = Path(__file__).resolve().parents[2]
#: folders / files (relative to the package) that may tell a family apart (module docstring)
ALLOWED = ("drafter/families/", "drafter/model.py", "drafter/train.py")
#: a family's own fields and module parts, read by name only in :data:`ALLOWED`
FAMILY_ATTRIBUTES = {"selector_top_k", "candidate_selector"}


def _docstrings(tree: ast.AST) -> set[int]:
    """``id`` of every docstring node (module, class, function)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _constants(node: ast.AST) -> list:
    """The constant values of an operand: a constant, or the elements of a literal tuple / list / set."""
    if isinstance(node, ast.Constant):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant)]
    return []


def family_tests(source: str, names: set[str], default: str) -> list[tuple[int, str]]:
    """``(line, what)`` of every family test in a module's ``source`` (module docstring): ``names`` are the family
    names, ``default`` the default family's."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    others = names - {default}
    out, compared = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            text = ast.unparse(node)
            for op in operands:
                hit = [v for v in _constants(op) if v in others or (v == default and "variant" in text)]
                if hit:
                    out.append((node.lineno, f"compares with family name {hit[0]!r}: {text}"))
                    compared.update(id(n) for n in ast.walk(op))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in others and id(node) not in docs and id(node) not in compared:
            out.append((node.lineno, f"family name {node.value!r} as a value"))
        elif isinstance(node, ast.Name) and node.id == "is_dflash2" or isinstance(node, ast.Attribute) and \
                node.attr == "is_dflash2" or isinstance(node, (ast.FunctionDef, ast.alias)) and \
                getattr(node, "name", None) == "is_dflash2":
            out.append((node.lineno, "is_dflash2"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in FAMILY_ATTRIBUTES:
            out.append((node.lineno, f"{node.func.id} probe of {node.args[1].value!r}"))
        elif isinstance(node, ast.Attribute) and node.attr in FAMILY_ATTRIBUTES:
            out.append((node.lineno, f"reads .{node.attr}"))
        elif isinstance(node, ast.keyword) and node.arg in FAMILY_ATTRIBUTES:
            out.append((getattr(node, "lineno", 0), f"passes {node.arg}="))
    return sorted(set(out))


def package_family_tests(package: Path) -> dict[str, list[tuple[int, str]]]:
    """``{module path: family tests}`` of every module of ``package`` outside :data:`ALLOWED`."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel.startswith(ALLOWED):
            continue
        found = family_tests(path.read_text(), set(FAMILIES), DEFAULT)
        if found:
            out[rel] = found
    return out


def test_no_module_outside_the_families_tells_a_family_apart():
    assert package_family_tests(ROOT / "dflash_eval") == {}


def test_the_family_rule_finds_each_kind_of_test():
    """The check can fail: each kind of family test found today's main held is reported, prose is not."""
    src = '''
"""Docstring naming "dflash2" and is_dflash2 in prose."""
from dflash_eval.replay.layouts import is_dflash2
def f(cfg, drafter, frame, r):
    """variant == "dflash2" in a docstring"""
    a = cfg.variant == "dflash2"
    b = getattr(drafter, "candidate_selector", None) is not None
    c = frame["variant"] == "dflash2"
    d = r.get("variant", "dflash") != "dflash"
    e = cfg.selector_top_k
    g = dict(variant="dflash2")
    h = cfg.get("projector_type", "dflash") != "dflash"
    raise ValueError("a dflash2 drafter")
'''
    found = family_tests(src, {"dflash", "dflash2"}, "dflash")
    assert [line for line, _ in found] == [3, 6, 7, 8, 9, 10, 11]
    assert found[1] == (6, "compares with family name 'dflash2': cfg.variant == 'dflash2'")
    assert found[2] == (7, "getattr probe of 'candidate_selector'")
    assert found[6] == (11, "family name 'dflash2' as a value")


def test_the_family_rule_fails_on_the_package_before_the_families(tmp_path):
    """Today's main's evaluate stage and layouts, as they were (excerpts), are refused."""
    layouts = '''
def is_dflash2(drafter) -> bool:
    return getattr(drafter, "candidate_selector", None) is not None
'''
    policies = '''
def applicable_policies(variant, setting):
    if variant == "dflash2" or (setting.top_p >= 1 and not setting.top_k):
        return ["reference", "argmax"]
'''
    names, default = set(FAMILIES), DEFAULT
    assert family_tests(layouts, names, default) == [(2, "is_dflash2"), (3, "getattr probe of 'candidate_selector'")]
    assert len(family_tests(policies, names, default)) == 1


# ----------------------------------------------------------------------------- the registry


def test_registry_names_labels_architectures():
    assert list(FAMILIES) == ["dflash", "dflash2", "lilicorr"] and DEFAULT == "dflash"
    assert (DFLASH.label, DFLASH2.label, LILICORR.label) == ("DFlash 1", "DFlash 2", "LiLiCorr")
    assert family_of_architecture("LiLiCorrDraftModel") is LILICORR and LILICORR.speculators_model_type is None
    assert (LILICORR.selects_candidates, LILICORR.ddtree_applicable, LILICORR.walk_reads_context) == (True, False, True)
    assert not DFLASH2.walk_reads_context and ordered(["lilicorr", "dflash2"]) == ["dflash2", "lilicorr"]
    # LiLiCorr's tau.csv columns are DFlash 2's candidate columns (backbone chain = tau_unary, lattice oracle)
    assert LILICORR.table_columns(3) == DFLASH2.table_columns(3)[:6] + [
        "topk_recall_slot_1", "topk_recall_slot_2", "pick_rate_slot_1", "pick_rate_slot_2"]
    assert (DFLASH.architecture, DFLASH2.architecture) == ("DFlashDraftModel", "DFlash2DraftModel")
    assert family_of_architecture("DFlash2DraftModel") is DFLASH2 and family_of_architecture("X") is None
    assert family_of_speculators("dflash") is DFLASH and family_of_speculators("eagle3") is None
    assert family_of("dflash2") is DFLASH2 and family_of(None) is DFLASH and family_of(math.nan) is DFLASH
    assert family_of(SimpleNamespace(variant="dflash2")) is DFLASH2 and family_of(DFLASH2) is DFLASH2
    with pytest.raises(KeyError, match="unknown drafter family 'eagle'"):
        family_of("eagle")
    assert ordered(["zeta", "dflash2", "dflash"]) == ["dflash", "dflash2", "zeta"]
    assert (label("dflash2"), label("zeta")) == ("DFlash 2", "zeta")
    assert (DFLASH.ddtree_applicable, DFLASH2.ddtree_applicable) == (True, False)
    assert (DFLASH.selects_candidates, DFLASH2.selects_candidates) == (False, True)
    assert DFLASH2.config_fields == ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def test_the_registry_imports_without_torch():
    code = "import sys, dflash_eval.drafter.families as f; print(len(f.FAMILIES), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["3", "False"]


FIELDS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6}
SIZES = {"hidden_size": 64, "vocab_size": 100, "block_size": 4}


def test_config_family_and_strict_fields():
    assert family_of_config({"dflash_config": {"block_size": 4}}) is DFLASH
    assert family_of_config({"dflash_config": {"selector_rank": 8}}) is DFLASH2
    assert family_of_config({"architectures": ["DFlash2DraftModel"]}) is DFLASH2  # then refused: no fields
    notes: list[str] = []
    cfg = {"architectures": ["Qwen3ForCausalLM"], "dflash_config": dict(FIELDS, conv_kernel_size=5)}
    assert DFLASH2.read_fields(cfg, cfg["dflash_config"], "c.json", SIZES, notes) == dict(FIELDS, conv_kernel_size=5)
    assert notes == ["conv_kernel_size 5 > block_size 4: taps past the block start read zeros (SpecForge and "
                     "speculators refuse to train this)",
                     "architectures ['Qwen3ForCausalLM'] with the DFlash 2 fields: read as DFlash2DraftModel (the "
                     "stripped config.json names it)"]
    for dcfg, field, problem in [
        ({"selector_rank": 8}, "dflash_config.conv_kernel_size", "['conv_kernel_size', 'conv_group_size', "
         "'selector_top_k'] missing"),
        ({}, "dflash_config.conv_kernel_size", "architectures names DFlash2DraftModel but none of"),
        (dict(FIELDS, conv_group_size=24), "dflash_config.conv_group_size", "24 does not divide hidden_size 64"),
        (dict(FIELDS, selector_top_k=101), "dflash_config.selector_top_k", "101 candidates per slot exceed vocab"),
        (dict(FIELDS, selector_rank=True), "dflash_config.selector_rank", "must be a positive integer, got True"),
    ]:
        with pytest.raises(InputError) as exc:
            DFLASH2.read_fields({"architectures": ["DFlash2DraftModel"]}, dcfg, "c.json", SIZES, [])
        assert (exc.value.file, exc.value.field) == ("c.json", field) and problem in exc.value.problem
    class Other(type(DFLASH2)):  # a family sharing a DFlash 2 field name: the architecture decides
        name, config_fields, architecture = "other", ("selector_rank",), "OtherModel"
    FAMILIES["other"] = Other()
    try:
        assert family_of_config({"architectures": ["OtherModel"], "dflash_config": {"selector_rank": 8}}).name == "other"
        assert family_of_config({"architectures": ["DFlash2DraftModel"], "selector_rank": 8}) is DFLASH2
        with pytest.raises(InputError, match=r"the fields of several drafter families are set: \['dflash2', 'other'\]"):
            family_of_config({"dflash_config": {"selector_rank": 8}}, source="c.json")
    finally:
        del FAMILIES["other"]


def test_strip_config_writes_the_family_fields_and_architecture():
    out = {"architectures": ["Qwen3ForCausalLM"], "output_multiplier": 2.0,
           "dflash_config": {"target_layer_ids": [1], "mask_token_id": 0, "block_size": 4}}
    DFLASH2.strip_config(out, FIELDS)
    assert out["architectures"] == ["DFlash2DraftModel"]
    assert out["dflash_config"] == {"target_layer_ids": [1], "mask_token_id": 0, "block_size": 4, **FIELDS,
                                    "output_multiplier": 2.0}
    assert list(out["dflash_config"])[3] == "conv_kernel_size"  # the order strip wrote before the families
    one = {"dflash_config": {}}
    DFLASH.strip_config(one, {})
    assert one == {"dflash_config": {}, "architectures": ["DFlashDraftModel"]}
    kept = {"architectures": ["Qwen3ForCausalLM"], "dflash_config": {}}
    DFLASH.strip_config(kept, {})
    assert kept["architectures"] == ["Qwen3ForCausalLM"]  # DFlash 1 keeps a named architecture


def test_speculators_and_demo_fields():
    flat = dict(FIELDS, mask_token_id=3, conv_group_size=None)
    assert DFLASH2.speculators_fields(flat) == {"conv_kernel_size": 2, "selector_rank": 8, "selector_top_k": 6}
    assert DFLASH.speculators_fields(flat) == {}
    # SmolLM2-135M: hidden 576 (16 divides it), vocab 49152; a width 40 drops to group size 1 and rank 40
    assert DFLASH2.demo_fields(576, 49152) == {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256,
                                               "selector_top_k": 16}
    assert DFLASH2.demo_fields(40, 10) == {"conv_kernel_size": 2, "conv_group_size": 1, "selector_rank": 40,
                                           "selector_top_k": 10}
    assert DFLASH2.demo_fields(576, 49152, {"selector_rank": 4, "selector_top_k": None}) == {
        "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 4, "selector_top_k": 16}
    assert DFLASH.demo_fields(576, 49152) == {}


PLAIN = SimpleNamespace(greedy=False, top_p=1.0, top_k=0)
FILTERED = SimpleNamespace(greedy=False, top_p=0.95, top_k=20)
GREEDY = SimpleNamespace(greedy=True, top_p=1.0, top_k=0)


def test_draft_policies_and_engines():
    assert DFLASH.draft_policies(GREEDY) == DFLASH2.draft_policies(GREEDY) == ["reference"]
    assert DFLASH.draft_policies(FILTERED) == ["reference", "argmax", "probabilistic"]
    assert DFLASH.draft_policies(PLAIN) == DFLASH2.draft_policies(FILTERED) == ["reference", "argmax"]
    assert DFLASH.engine_settings(FILTERED, "reference") == ["dflash 0.1.0 dflash_generate"]
    assert DFLASH2.engine_settings(FILTERED, "reference") == ["dflash 0.1.0 dflash_generate",
                                                              "vLLM draft_sample_method=probabilistic"]
    assert DFLASH.vllm_draft_sample_method(FILTERED, "reference") is None
    assert DFLASH2.vllm_draft_sample_method(FILTERED, "reference") == "probabilistic"
    DFLASH.check_policy(PLAIN, "probabilistic")  # accepted at plain temperature: it equals the reference
    with pytest.raises(InputError) as exc:
        DFLASH2.check_policy(FILTERED, "probabilistic", "c.yaml", "evaluate.sampling[1]")
    assert (exc.value.field, exc.value.problem) == ("evaluate.sampling[1].draft",
                                                    "draft policy 'probabilistic' does not apply to a dflash2 drafter")
    assert exc.value.fix == "use one of ['reference', 'argmax']"


def test_table_columns_and_values():
    assert DFLASH.table_columns(4) == [] and DFLASH.table_values({"selector": {}}) == {}
    assert DFLASH2.table_columns(3) == ["tau_oracle", "tau_unary", "sel_accepted", "sel_oracle_accepted",
                                        "sel_pick_rate", "sel_oracle_path_rate", "topk_recall_slot_1",
                                        "topk_recall_slot_2", "pick_rate_slot_1", "pick_rate_slot_2"]
    result = {"block_size": 3, "selector": {"accepted": 1.5, "oracle_accepted": 1.75, "pick_rate_all": 0.5,
                                            "oracle_path_rate": None, "topk_recall": {"1": 0.75, "2": None},
                                            "pick_rate": {"1": 0.5, "2": 0.25}},
              # two responses: steps committing (2, 1) and (3,): tau = mean of per-response means = (1.5 + 3) / 2
              "samples": [{"acceptance_lengths_oracle": [2, 1], "acceptance_lengths_unary": [1, 1]},
                          {"acceptance_lengths_oracle": [3], "acceptance_lengths_unary": [2]}]}
    vals = DFLASH2.table_values(result)
    assert vals["tau_oracle"] == pytest.approx(2.25) and vals["tau_unary"] == pytest.approx(1.5)
    assert (vals["sel_accepted"], vals["sel_pick_rate"], vals["topk_recall_slot_1"]) == (1.5, 0.5, 0.75)
    assert math.isnan(vals["sel_oracle_path_rate"]) and math.isnan(vals["topk_recall_slot_2"])
    assert DFLASH2.table_values({"block_size": 3, "samples": []}) == {}
    assert "variant `dflash2`" in DFLASH2.report_note and DFLASH2.report_sections == ("selector",)
    assert json.loads(json.dumps(DFLASH2.table_columns(2))) == DFLASH2.table_columns(2)
