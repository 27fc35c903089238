#!/usr/bin/env python
"""Fixed cost of each pipeline stage: wall time of ``python -m dflash_eval <stage>`` on a tiny input.

A tiny random target (4 layers, hidden 64: its weights load in milliseconds), 4 prompts, 8 new
tokens, one random 1-layer drafter: whatever a stage spends here is what it spends before and
after its real work on any input (interpreter and imports, config and schema reads, hashing,
CUDA initialisation, checks), i.e. its fixed cost. Every stage runs in a fresh process as the
workflow runs it (one ``python -m dflash_eval`` call per rule), in pipeline order:
``target-fingerprint -> prompts -> completions -> hidden-states -> demo-checkpoint ->
strip-drafter -> evaluate -> validate-online``.

Printed per stage: wall seconds; of those, the imports (``python -X importtime``: the sum over
top-level modules) and the heaviest top-level imports; the rest (the stage's own fixed work:
CUDA init, reads, hashing). Then per stage the wall time of ``<stage> --help`` and how many
modules it imports (``--help`` should import no torch/transformers for stages that need none at
parse time; ``tests/core/test_startup.py`` checks the module set, not wall times). The goal: at most
5 s per stage beyond loading the target's weights.

On one H200 (torch 2.11, transformers 5.17), from the repository root::

    python3 bench/startup.py                 # device auto = cuda, ~1-2 min

CPU smoke run (also what ``tests/core/test_startup.py`` runs; the same stages, CPU)::

    .venv/bin/python bench/startup.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

HEAVY = ("torch", "transformers", "h5py", "pandas", "numpy", "matplotlib", "jsonschema", "yaml", "safetensors",
         "huggingface_hub", "tokenizers", "scipy", "sympy")


def imports(stderr: str) -> tuple[float, list[tuple[float, str]]]:
    """Top-level imports from ``-X importtime`` output: (total seconds, [(seconds, module)] heaviest first)."""
    top = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        _, cum, name = line[len("import time:"):].split("|")
        if name.startswith("  "):  # nested: counted in its parent
            continue
        top.append((int(cum) / 1e6, name.strip()))
    top.sort(reverse=True)
    return sum(t for t, _ in top), top


def run(argv: list[str], env: dict, importtime: bool = True) -> tuple[float, subprocess.CompletedProcess]:
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "dflash_eval", *argv]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:1])} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall, proc


def help_modules(stage: str, env: dict) -> list[str]:
    """Modules (of :data:`HEAVY`) that ``python -m dflash_eval <stage> --help`` imports."""
    code = ("import sys, contextlib, io\nfrom dflash_eval.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    try:\n        main([{stage!r}, '--help'])\n    except SystemExit:\n        pass\n"
            f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=REPO)
    if out.returncode != 0:
        raise SystemExit(f"{stage} --help failed:\n{out.stderr[-2000:]}")
    return out.stdout.split()


def stages(root: Path, device: str) -> list[tuple[str, list[str]]]:
    """The pipeline's stages on the tiny inputs under ``root`` (built here), in order."""
    from tiny import make_tiny_target

    t = make_tiny_target(root / "target")
    (root / "prompts.txt").write_text("".join(f"Write a short poem about the number {i}.\n" for i in range(4)))
    dev = ["--device", device]
    fp, prompts, comp, cache = root / "fp.json", root / "p.jsonl", root / "c.jsonl", root / "cache.h5"
    ckpt, drafter, ev = root / "d.pt", root / "drafter", root / "eval.json"
    return [
        ("target-fingerprint", ["--target", str(t), "--out", str(fp)]),
        ("prompts", ["--source", "file", "--path", str(root / "prompts.txt"), "--tokenizer", str(t), "--n", "4",
                     "--out", str(prompts)]),
        ("completions", ["--target", str(t), "--prompts", str(prompts), "--target-fingerprint", str(fp),
                         "--max-new-tokens", "8", *dev, "--out", str(comp)]),
        ("hidden-states", ["--target", str(t), "--completions", str(comp), "--layer-ids", "1,2",
                           "--target-fingerprint", str(fp), *dev, "--out", str(cache)]),
        ("demo-checkpoint", ["--target", str(t), "--random-init", "--layer-ids", "1,2", "--block-size", "4",
                             "--out", str(ckpt)]),
        ("strip-drafter", ["--checkpoint", str(ckpt), "--target", str(t), "--out", str(drafter)]),
        ("evaluate", ["--drafter", str(drafter), "--cache", str(cache), "--target", str(t), "--target-fingerprint",
                      str(fp), "--allow-low-agreement", *dev, "--out", str(ev)]),
        ("validate-online", ["--target", str(t), "--completions", str(comp), "--drafter", str(drafter), "--evals",
                             str(ev), "--n-samples", "2", *dev, "--out", str(root / "online.json")]),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU (what the test suite runs)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--only", default="", help="comma-separated stages (default: all)")
    ap.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = ap.parse_args(argv)
    device = "cpu" if args.smoke else args.device
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    env.setdefault("HF_HUB_OFFLINE", "1")
    results = []
    with tempfile.TemporaryDirectory(prefix="dflash-startup-") as tmp:
        plan = stages(Path(tmp), device)
        only = set(filter(None, args.only.split(",")))
        print(f"fixed cost per stage (tiny inputs, device {device}; python {sys.version.split()[0]}):")
        for name, stage_argv in plan:
            if only and name not in only:
                # inputs of later stages still have to exist
                run([name, *stage_argv], env, importtime=False)
                continue
            wall, proc = run([name, *stage_argv], env)
            total, top = imports(proc.stderr)
            heavy = ", ".join(f"{m} {s:.2f}" for s, m in top[:4])
            print(f"  {name:19s} {wall:6.2f} s  imports {total:5.2f} s [{heavy}]  rest {wall - total:5.2f} s",
                  flush=True)
            results.append({"stage": name, "wall_s": wall, "imports_s": total, "rest_s": wall - total,
                            "top_imports": top[:8]})
        print("--help per stage (wall s; heavy modules imported):")
        for name, _ in plan:
            if only and name not in only:
                continue
            t0 = time.perf_counter()
            mods = help_modules(name, env)
            print(f"  {name:19s} {time.perf_counter() - t0:6.2f} s  {' '.join(mods) or '-'}", flush=True)
            next(r for r in results if r["stage"] == name)["help_modules"] = mods
    worst = max(results, key=lambda r: r["wall_s"])
    print(f"largest fixed cost: {worst['stage']} {worst['wall_s']:.2f} s (goal <= 5 s beyond loading weights)")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
