"""The package's shape, read from the source: folders in layers (no arrow back up, no circle), few modules at the
top, no stage importing the parse-time layer, imports at the top of the file unless a reason is written beside
them, no module over 600 lines, one stage module per rule (named as the rule), rules that hold only rules, and one
way an option travels (the schema).

The import graph includes imports inside functions (a deferred import still ties two modules together;
hiding a circle behind one is how circles come back).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "dflash_eval"
MAX_LINES = 600


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def import_graph() -> dict[str, set[str]]:
    """``module -> modules of the package it imports`` (every ``import`` / ``from`` anywhere in the file)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names]  # `from . import options`
            for t in targets:
                while t and t not in mods:  # `dflash_eval.cache.format.X` -> the module
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("dflash_eval"):
                    graph[name].add(t)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


#: the package's folders, lowest first: a module may import its own folder and the folders before it, never one
#: after it. ``workflow`` (parse time, torch-free) and ``stages`` (one module per rule) share a rank and never import
#: each other; the top level (``cli``, ``watch``) drives them. ``dflash_eval`` itself holds only ``__version__``.
LAYERS = [("dflash_eval",), ("core",), ("target",), ("replay",), ("data",), ("cache",), ("drafter",), ("serving",),
          ("report",), ("trackers",), ("workflow", "stages"), ("top",)]
MAX_TOP_MODULES = 12
MAX_DEFERRED_IMPORTS = 40


def _folder(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "dflash_eval"
    return parts[1] if (PKG / parts[1]).is_dir() else "top"


def _rank(folder: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if folder in names)


def arrows_back_up(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """``(importer, imported)`` pairs that import a later layer, or the sibling of the same rank."""
    out = []
    for a, bs in graph.items():
        for b in bs:
            fa, fb = _folder(a), _folder(b)
            if fa != fb and (_rank(fb) > _rank(fa) or (_rank(fb) == _rank(fa))):
                out.append((a, b))
    return sorted(out)


def test_folders_are_layers_with_no_arrow_back_up():
    graph = import_graph()
    folders = {_folder(m) for m in graph}
    assert folders <= {f for names in LAYERS for f in names}, folders
    assert arrows_back_up(graph) == []
    assert not any(b.startswith("dflash_eval.workflow") for a, bs in graph.items() if a.startswith("dflash_eval.stages")
                   for b in bs)


def test_the_layer_check_can_fail():
    graph = {"dflash_eval.core.io": {"dflash_eval.replay.walk"}, "dflash_eval.stages.evaluate": {"dflash_eval.workflow.plan"},
             "dflash_eval.replay.walk": {"dflash_eval.core.io"}}
    assert arrows_back_up(graph) == [("dflash_eval.core.io", "dflash_eval.replay.walk"),
                                     ("dflash_eval.stages.evaluate", "dflash_eval.workflow.plan")]


def test_few_modules_at_the_top():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top


def deferred_imports() -> list[tuple[str, int, str]]:
    """``(file, line, reason)`` of every import inside a function of the package; the reason is the comment on the
    import's line (``# deferred: ...``), or '' when there is none."""
    out = []
    for path in sorted(PKG.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.Import, ast.ImportFrom)):
                        text = lines[sub.lineno - 1]
                        reason = text.partition("#")[2].strip() if "#" in text else ""
                        out.append((str(path.relative_to(ROOT)), sub.lineno, reason))
    return sorted(set(out))


def test_imports_sit_at_the_top_unless_a_reason_is_given():
    found = deferred_imports()
    assert [f"{f}:{n}" for f, n, why in found if not why] == []
    assert len(found) <= MAX_DEFERRED_IMPORTS, len(found)


def test_import_graph_has_no_circle():
    graph = import_graph()
    assert graph["dflash_eval.stages.evaluate"] >= {"dflash_eval.replay.anchors", "dflash_eval.replay.ddtree"}  # the reader works
    assert circles(graph) == []


def test_the_circle_finder_finds_a_deferred_import_circle(tmp_path):
    """The check can fail: a circle through an import inside a function is reported."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    src = "def f():\n    from .replay import replay\n"
    tree = ast.parse(src)
    assert any(isinstance(n, ast.ImportFrom) and n.module == "replay" and n.level == 1 for n in ast.walk(tree))


def test_no_module_over_600_lines():
    long = {name: n for name, p in _modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def _rules() -> dict[str, str]:
    """``rule name -> its rule file's text`` for every rule under rules/."""
    out = {}
    for f in sorted((ROOT / "rules").glob("*.smk")):
        for m in re.finditer(r"^\s*rule (\w+):", f.read_text(), re.M):
            out[m.group(1)] = f.name
    return out


def test_each_rule_has_its_stage_module_and_calls_it():
    from dflash_eval.cli import COMMANDS

    rules = {r for r in _rules() if r != "all"}
    stages = {p.stem for p in (PKG / "stages").glob("*.py") if p.stem != "__init__"}
    assert stages == rules
    by_module = {mod.split(".")[-1]: cmd for cmd, (mod, _) in COMMANDS.items()}
    text = "\n".join((ROOT / "rules" / f).read_text() for f in set(_rules().values()))
    for rule in rules:
        assert by_module[rule] == rule.replace("_", "-")
        assert f"python -m dflash_eval {by_module[rule]} " in text, rule


def test_rule_files_hold_only_rules():
    """Parse-time checks and globals live in the plan (dflash_eval/workflow/plan.py) and rules/common.smk only."""
    for f in sorted((ROOT / "rules").glob("*.smk")):
        if f.name == "common.smk":
            continue
        top = [line for line in f.read_text().splitlines()
               if line and not line[0].isspace() and not line.startswith(("#", "rule ", "if ", "include:"))]
        assert top == [], f"{f.name}: {top}"
        text = f.read_text().replace('config["containers"]', "")  # the image of every rule
        assert "WorkflowError" not in text and not re.search(r"(?<![.\w])config\[", text), f.name


@pytest.mark.parametrize("stage", ["prompts", "completions", "hidden_states", "evaluate", "kernel_parity", "fp8_parity",
                                   "engine_parity", "validate_online", "validate_engine", "target_costs", "summary",
                                   "reslice"])
def test_every_schema_option_of_a_stage_is_a_flag_and_a_field(stage):
    """One definition: the schema entries a stage reads are its dataclass fields and CLI flags, with the schema's
    defaults; the rule passes every one of them."""
    import dataclasses

    from dflash_eval.core import options
    from dflash_eval.cli import build_parser

    cmd = stage.replace("_", "-")
    sub = build_parser(cmd)._subparsers._group_actions[0].choices[cmd]
    flags = {s for a in sub._actions for s in a.option_strings}
    leaves = options._leaves(stage)
    assert leaves
    opts = options.make(stage)
    for path, dotted, node in leaves:
        assert options.flag_name(path) in flags, dotted
        value = opts
        for part in path:
            value = getattr(value, part)
        assert value == node.get("default"), dotted
    config = {"target": {}, "cache": {}, "generation": {}, "evaluate": {}, "prompt_set": {}}
    words = options.to_flags(stage, options.section_values(stage, config))
    # every option but those left out at their default (x-flag-unless-default: the parser has the same default)
    assert len(words) == len([n for _, _, n in leaves if not n.get("x-flag-unless-default")])
    assert dataclasses.is_dataclass(opts)
