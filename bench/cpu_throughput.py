"""Side-by-side CPU measurements of the two hot paths (run after `make demo`; inputs from its outputs).

1. Hidden-state extraction: our forward hooks on the K stored layers (`extract.run_target`) vs HF
   `output_hidden_states=True` (all N+1 states materialised) — tokens/s and peak RSS growth.
2. Sequential replay: lazy LM head (`replay.SLOT_CHUNK = 4`, logits only while drafts still match) vs all
   B-1 slots at once — seconds per checkpoint and prompt set, tau identical by construction.

Usage:
    .venv/bin/python bench/cpu_throughput.py [--target resources/targets/smollm2-135m-instruct]
        [--completions results/demo/completions/humaneval.jsonl] [--cache results/demo/cache/humaneval.h5]
        [--drafter results/demo/drafters/dflash-smollm2-b8-step2283]
Prints one line per measurement and the ratios. Float32 on CPU (bf16 matmuls are very slow here).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_extraction(target_dir, completions, layer_ids, n):
    from dflash_eval.data.completions import read_completions
    from dflash_eval.cache.extract import run_target
    from dflash_eval.target.model import load_target

    model, _, _ = load_target(target_dir, device="cpu", dtype="float32")
    rows = read_completions(__import__("pathlib").Path(completions))[:n]
    seqs = [r["prompt_ids"] + r["completion_ids"] for r in rows]
    tokens = sum(map(len, seqs))
    out = {}
    for name in ("hooks (dflash-eval)", "output_hidden_states=True"):
        base = rss_mb()
        t0 = time.perf_counter()
        with torch.inference_mode():
            for s in seqs:  # one sample per forward: the same work on both sides
                if name.startswith("hooks"):
                    run_target(model, [s], layer_ids, "cpu")
                else:
                    o = model(torch.tensor([s]), output_hidden_states=True)
                    torch.stack([o.hidden_states[i + 1][0] for i in layer_ids], 1)
                    o.logits.argmax(-1)
        dt = time.perf_counter() - t0
        out[name] = (tokens / dt, rss_mb() - base)
        print(f"extraction  {name:28s} {tokens / dt:8.0f} tok/s  peak RSS +{rss_mb() - base:6.0f} MB  ({tokens} tokens)")
    (a, _), (b, _) = out.values()
    print(f"extraction  ratio hooks / output_hidden_states: {a / b:.2f}x tokens/s")


def bench_replay(drafter, cache, target_dir):
    import dflash_eval.replay.chain as rp
    from dflash_eval.stages.evaluate import evaluate

    times = {}
    for chunk in (4, 64):
        rp.SLOT_CHUNK = chunk
        t0 = time.perf_counter()
        r = evaluate(drafter, cache, target_dir, "/tmp/bench_replay.json", device="cpu", dtype="float32",
                        replay="sequential")  # SLOT_CHUNK is the sequential replay's
        times[chunk] = time.perf_counter() - t0
        print(f"replay      slot chunk {chunk:3d}: {times[chunk]:6.1f} s  tau {r['tau']:.4f}  ({r['verify_steps']} verify steps)")
    print(f"replay      ratio all-slots / lazy: {times[64] / times[4]:.2f}x time")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="resources/targets/smollm2-135m-instruct")
    ap.add_argument("--completions", default="results/demo/completions/humaneval.jsonl")
    ap.add_argument("--cache", default="results/demo/cache/humaneval.h5")
    ap.add_argument("--drafter", default="results/demo/drafters/dflash-smollm2-b8-step2283")
    ap.add_argument("--layer-ids", default="1,8,15,22,27")
    ap.add_argument("--n", type=int, default=8, help="samples for the extraction benchmark")
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32 on CPU")
    bench_extraction(a.target, a.completions, [int(x) for x in a.layer_ids.split(",")], a.n)
    bench_replay(a.drafter, a.cache, a.target)


if __name__ == "__main__":
    main()
