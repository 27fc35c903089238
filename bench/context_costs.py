"""target_costs against context and batch on one GPU: the break-even tau of a user-scale target.

For each model (random weights from a transformers config, built on the GPU in bf16 by
``bench/extraction.py``'s ``build_target``: the 8.16B Qwen3.5-style hybrid ``hybrid-7b`` with fla
kernels and the 8.03B ``llama-8b``, both with ``max_position_embeddings`` above the longest context),
a z-lab-style DFlash drafter config (5 layers, block 16, hidden size of the target) is written and the
workflow's own CLI times the costs exactly as rule ``target_costs`` does::

    python -m dflash_eval target-costs --target <t> --drafter-config <c> --contexts 1024,8192,32768 \\
        --batch-sizes 1,16 --budgets 16,64 --device cuda --out <json>

It prints, per (context, batch), the decode step, the block-16 verify, the drafter's block pass and the
chain's break-even tau ``(t_verify + t_draft) / t_decode`` (:mod:`dflash_eval.target.cost_context`),
and each cost at the longest context relative to the shortest. Random weights: costs depend on shapes.

    python3 bench/context_costs.py                  # one H100 / H200: both models (about 5 min)
    .venv/bin/python bench/context_costs.py --smoke # CPU, tiny models (tests/bench/test_bench_smoke.py)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))

import extraction as ex  # noqa: E402  (bench/extraction.py: the model table and build_target)

#: name -> (bench/extraction.py MODELS entry, drafter target_layer_ids, drafter layers, block size)
MODELS = {"hybrid-7b": ("hybrid-7b", [1, 9, 17, 25, 31], 5, 16), "llama-8b": ("llama-8b", [1, 9, 17, 25, 31], 5, 16)}


def run_model(name: str, contexts: list[int], batches: list[int], budgets: str, repeats: int, smoke: bool,
              device: str, work: Path) -> dict:
    """Build ``name``, time it with the target-costs CLI, return the costs JSON (format 3)."""
    from dflash_eval.drafter.demo import drafter_config_for_target

    entry, layers, d_layers, block = MODELS[name]
    cfg = (ex.SMOKE if smoke else ex.MODELS)[entry][0]
    if smoke:
        layers, d_layers, block = [1, 3], 1, 4
    target = work / name / "target"
    info = ex.build_target(target, cfg, over={"max_position_embeddings": max(contexts) + 512})
    vocab = json.loads((target / "config.json").read_text()).get("vocab_size") or json.loads(
        (target / "config.json").read_text())["text_config"]["vocab_size"]
    drafter = work / name / "drafter"
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text(json.dumps(drafter_config_for_target(target, layers, block, d_layers, vocab - 1)))
    print(f"{name}: random {info['kind']} target, {info['dense_params'] / 1e9:.2f}B dense parameters; drafter "
          f"{d_layers} layers, block {block}, target layers {layers}", flush=True)
    out = work / f"target_costs_{name}.json"
    cmd = [sys.executable, "-m", "dflash_eval", "target-costs", "--target", str(target), "--drafter-config",
           str(drafter / "config.json"), "--contexts", ",".join(map(str, contexts)), "--context-tokens",
           str(contexts[0]), "--batch-sizes", ",".join(map(str, batches)), "--budgets", budgets, "--repeats",
           str(repeats), "--warmup", "2", "--device", device, "--out", str(out)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])})
    return json.loads(out.read_text())


def report(name: str, costs: dict) -> list[str]:
    """The printed lines of one model: per (context, batch) decode, verify, draft (ms) and break-even tau."""
    from dflash_eval.target.cost_context import break_even, entry_terms

    ck, d = next(iter(costs["drafters"].items()))
    block = d["block_size"]
    lines = [f"{name} on {costs['device_name']} ({costs['dtype']}, torch {costs['torch_version']}, transformers "
             f"{costs['transformers_version']}, kernel {costs.get('linear_attn_kernel')}), minimum of "
             f"{costs['repeats']} runs; skipped: {costs.get('skipped') or 'none'}",
             f"  {'context':>8} {'batch':>5} {'decode ms':>10} {'verify ms':>10} {'draft ms':>9} {'break-even tau':>15}"]
    rows = {}
    for e in sorted(costs["grid"], key=lambda e: (e["batch_size"], e["context_tokens"])):
        c, b = int(e["context_tokens"]), int(e["batch_size"])
        dec, ver, dra = entry_terms(e, ck, block, "causal")
        rows[(c, b)] = (dec, ver, dra, break_even(dec, ver, dra))
        lines.append(f"  {c:>8} {b:>5} {1e3 * dec:>10.3f} {1e3 * ver:>10.3f} {1e3 * dra:>9.3f} {rows[(c, b)][3]:>15.2f}")
    ctx = sorted({c for c, _ in rows})
    for b in sorted({b for _, b in rows}):
        if (ctx[0], b) in rows and (ctx[-1], b) in rows:
            lo, hi = rows[(ctx[0], b)], rows[(ctx[-1], b)]
            lines.append(f"  batch {b}: context {ctx[-1]} / {ctx[0]}: decode {hi[0] / lo[0]:.2f}x, verify "
                         f"{hi[1] / lo[1]:.2f}x, draft {hi[2] / lo[2]:.2f}x, break-even tau {lo[3]:.2f} -> {hi[3]:.2f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="hybrid-7b,llama-8b")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--budgets", default="16,64", help="DDTree budgets timed at batch 1")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny models, contexts 64,256")
    ap.add_argument("--out", default=None, help="write every costs JSON into this JSON file")
    args = ap.parse_args()
    contexts = [64, 256] if args.smoke else [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    device = "cpu" if args.smoke else "cuda"
    results, lines = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            results[name] = run_model(name, contexts, batches, args.budgets, 2 if args.smoke else args.repeats,
                                      args.smoke, device, Path(tmp))
            block = report(name, results[name])
            lines += block
            print("\n".join(block), flush=True)
    print("\n".join(["", "summary"] + lines))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
