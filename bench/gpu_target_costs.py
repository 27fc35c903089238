"""target_costs on one GPU for random targets of real shapes, and the speedup estimate they give.

Needs: CUDA, torch, transformers, safetensors, tokenizers (no network, no hub). For each shape a
random-init target (bf16 safetensors + a tiny tokenizer) and a DFlash drafter config are written
to a temporary folder, then the workflow's own CLI measures the costs exactly as rule
target_costs does:

    python -m dflash_eval target-costs --target <t> --drafter-config <c> --device cuda --out <json>

and the script prints the measured costs and the estimated speedup tau * t_decode /
(t_verify(n) + t_draft) for the tau values given with --tau (default: the demo drafters' final
tau on HumanEval and ShareGPT, README "Demo results"). Random weights: costs depend on shapes.

    python3 bench/gpu_target_costs.py                       # both shapes below (about 2 min on one H200)
    python3 bench/gpu_target_costs.py --shape smollm2-1.7b --context-tokens 1024
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
sys.path.insert(0, str(REPO / "tests"))

# (hidden, intermediate, layers, heads, kv heads, drafter layers, block size, drafter target layers)
SHAPES = {
    # SmolLM2-135M-Instruct (the demo target) with the demo drafters' shape (2 layers, B = 8)
    "smollm2-135m": (576, 1536, 30, 9, 3, 2, 8, [1, 8, 15, 22, 27]),
    # SmolLM2-1.7B shape (1.7B parameters) with a z-lab-style drafter (5 layers, B = 16)
    "smollm2-1.7b": (2048, 8192, 24, 32, 32, 5, 16, [1, 6, 12, 17, 22]),
}
VOCAB = 49152


def build(shape: str, root: Path, device: str) -> tuple[Path, Path]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash_eval.drafter.demo import drafter_config_for_target
    from tiny import make_tiny_tokenizer

    hidden, inter, layers, heads, kv, d_layers, block, tli = SHAPES[shape]
    target = root / shape
    make_tiny_tokenizer(target)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(target))
    n_params = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    drafter = root / "drafters" / f"{shape}-drafter"
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text(json.dumps(drafter_config_for_target(target, tli, block, d_layers, VOCAB - 1)))
    print(f"{shape}: random target {n_params / 1e9:.2f}B parameters, drafter {d_layers} layers, block {block}", flush=True)
    return target, drafter / "config.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    ap.add_argument("--tau", default="1.600,1.918", help="comma-separated tau values to turn into speedups")
    ap.add_argument("--budgets", default="8,16,32,64,128,256")
    ap.add_argument("--context-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out-dir", default=None, help="keep the costs JSONs here")
    ap.add_argument("--device", default="cuda", help="'cpu' only to smoke-test this script")
    args = ap.parse_args()
    taus = [float(t) for t in args.tau.split(",") if t]
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="target-costs-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    for shape in SHAPES if args.shape == "all" else [args.shape]:
        with tempfile.TemporaryDirectory() as tmp:
            target, drafter_cfg = build(shape, Path(tmp), args.device)
            out = out_dir / f"target_costs_{shape}.json"
            cmd = [sys.executable, "-m", "dflash_eval", "target-costs", "--target", str(target), "--drafter-config",
                   str(drafter_cfg), "--budgets", args.budgets, "--context-tokens", str(args.context_tokens),
                   "--contexts", str(args.context_tokens), "--batch-sizes", "1",  # this bench: one context, batch 1
                   "--repeats", str(args.repeats), "--device", args.device, "--out", str(out)]
            print("$", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        c = json.loads(out.read_text())
        d = next(iter(c["drafters"].values()))
        t_dec = c["decode_s"]
        print(f"\n{shape} on {c['device_name']} ({c['dtype']}, torch {c['torch_version']}, transformers "
              f"{c['transformers_version']}), batch 1, context {c['context_tokens']}, median of {c['repeats']}:")
        print(f"  t_decode {1e3 * t_dec:.3f} ms; t_draft {1e3 * d['draft_s']:.3f} ms (chain, block {d['block_size']})")
        print(f"  {'method':>12} {'n':>4} {'t_verify ms':>12} {'/t_decode':>10} {'t_draft ms':>11} {'tau for 1.0x':>13}")
        verify = {(v["n"], v["mask"]): v["median_s"] for v in c["verify"]}
        rows = [("chain", d["block_size"], "causal", d["draft_s"])]
        rows += [(f"ddtree_{b}", int(b) + 1, "tree", t) for b, t in d["draft_tree_s"].items()]
        for name, n, mask, t_draft in rows:
            tv = verify[(n, mask)]
            print(f"  {name:>12} {n:>4} {1e3 * tv:>12.3f} {tv / t_dec:>10.2f} {1e3 * t_draft:>11.3f} "
                  f"{(tv + t_draft) / t_dec:>13.2f}")
        chain = (verify[(d["block_size"], "causal")] + d["draft_s"]) / t_dec
        print("  chain speedup estimate: " + ", ".join(f"tau {t:.3f} -> {t / chain:.2f}x" for t in taus))
        print(f"  ('tau for 1.0x' = (t_verify + t_draft) / t_decode: the tau a method needs to break even)\n  -> {out}")


if __name__ == "__main__":
    main()
