#!/usr/bin/env python
"""DDTree cost, side by side in one run: all node budgets from one drafter pass vs the chain alone.

Measured on the same random samples (the cost does not depend on the values of the hidden states):

1. **Batched all-anchor drafter pass** (device, :func:`dflash_eval.replay.chain.iter_anchor_drafts`, the
   pass ``evaluate`` runs): lazy greedy drafts only (what the chain alone needs) vs every slot's
   greedy draft + top-K full-vocabulary log-probs per slot (K = the largest budget; what the chain
   and every DDTree budget need together, :func:`dflash_eval.replay.ddtree.replay_with_trees`). Ratio =
   the extra device cost of DDTree, for all budgets together.
2. **Tree walks** (CPU, Python): every budget walked on its own trajectory
   (:func:`dflash_eval.replay.ddtree.walk_budgets`, one heap run per visited anchor shared by the budgets
   there) vs one separate heap per budget and anchor, vs the chain's walk. A random drafter
   accepts nothing, which would make every heap stop at once, so the walks run on **synthetic
   drafts** of the same shape with peaked per-slot distributions (``--peak``) whose top-1 is the
   continuation's token with probability ``--hit`` (the rest: a random rank among the top K, or
   outside it) -- a drafter that accepts a few tokens per step.

Printed: seconds per sample for each part, the ratios, and tau per budget of the synthetic walks.

Shapes (defaults, a Llama-3.2-style 2B target's head): hidden 2048, vocab 128256, drafter of
``--draft-layers`` layers, B = 16, 5 target layers, ``--prompt`` + ``--new`` tokens per sample.

On one H200 (bf16), from the repo root:

    python bench/ddtree.py --out $OUT/ddtree.json          # ~2 min
    python bench/ddtree.py --samples 16 --new 1024

CPU smoke run (small sizes, float32): ``.venv/bin/python bench/ddtree.py --smoke``
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from dflash_eval.cache.format import CacheSample# noqa: E402
from dflash_eval.replay.ddtree import accepted_depths, chain_from_greedy, walk_budgets  # noqa: E402
from dflash_eval.drafter.model import DFlashDrafter  # noqa: E402
from dflash_eval.drafter.config import DrafterConfig  # noqa: E402
from dflash_eval.replay.metrics import aggregate  # noqa: E402
from dflash_eval.replay.anchors import iter_anchor_drafts# noqa: E402

BUDGETS = [8, 16, 32, 64, 128, 256]


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def make_drafter(hidden, vocab, layers, block, n_tap, dev, dt):
    heads = max(hidden // 128, 1)
    cfg = {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": max(heads // 2, 1), "head_dim": hidden // heads, "intermediate_size": 3 * hidden,
           "vocab_size": vocab, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
           "dflash_config": {"target_layer_ids": list(range(1, 2 * n_tap, 2)), "block_size": block,
                             "mask_token_id": vocab - 1}}
    torch.manual_seed(0)
    d = DFlashDrafter(DrafterConfig.from_dict(cfg))
    with torch.no_grad():
        for p in d.parameters():
            if p.ndim == 2:
                p.normal_(std=0.02)
    return d.to(device=dev, dtype=dt).eval()


def make_samples(n, prompt, new, vocab, n_tap, hidden, g):
    out = []
    for i in range(n):
        T = prompt + new
        ids = torch.randint(0, vocab - 2, (T,), generator=g)
        out.append(CacheSample(i, f"s{i}", ids, prompt, torch.randn(T, n_tap, hidden, generator=g) * 0.5,
                               ids.clone(), "length", new))
    return out


def synthetic_drafts(x, P, B, K, hit, peak, g):
    """Peaked per-slot top-K log-probs; the continuation's token at rank 0 w.p. ``hit``, else a random rank
    (or absent, w.p. (1 - hit) / 4)."""
    n = len(x) - 1 - P
    logits = torch.randn(n, B - 1, 4 * K, generator=g) * peak
    lp = torch.topk(torch.log_softmax(logits, -1), K, dim=-1).values
    ids = torch.randint(0, 10**6, (n, B - 1, K), generator=g) + 10**6  # never the continuation's tokens
    u = torch.rand(n, B - 1, generator=g)
    rank = torch.where(u < hit, 0, torch.randint(1, K, (n, B - 1), generator=g))
    present = u < 1 - (1 - hit) / 4
    xt = torch.tensor(list(x) + [0] * B)
    for j in range(B - 1):
        tok = xt[P + 1 + j: P + 1 + j + n]
        rows = torch.nonzero(present[:, j]).flatten()
        ids[rows, j, rank[rows, j]] = tok[rows]
    return lp, ids


def per_budget_separately(lp, ids, x, P, max_new, B, budgets):
    """One heap per budget per visited anchor (no sharing): the baseline for the shared walk."""
    out = {}
    for b in budgets:
        t, T, steps = P, len(x), []
        while t < T - 1:
            limit = min(B, P + max_new - t) - 1
            d = accepted_depths(lp[t - P], ids[t - P], x[t + 1: t + 1 + limit], [b], limit)[0]
            steps.append(min(d + 1, T - 1 - t))
            t += steps[-1]
        out[b] = steps
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--hit", type=float, default=0.75, help="synthetic drafts: P(top-1 = continuation token)")
    ap.add_argument("--peak", type=float, default=5.0, help="synthetic drafts: logit scale (higher = more peaked)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, float32")
    ap.add_argument("--out", default=None, help="also write the figures as JSON here")
    a = ap.parse_args()
    if a.smoke:
        a.samples, a.prompt, a.new, a.hidden, a.vocab, a.device = 2, 32, 96, 128, 2048, "cpu"
    dev = torch.device(a.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    B, K = a.block_size, max(BUDGETS)
    drafter = make_drafter(a.hidden, a.vocab, a.draft_layers, B, 5, dev, dt)
    embed = (torch.randn(a.vocab, a.hidden, generator=g) * 0.02).to(dev, dt)
    head = (torch.randn(a.vocab, a.hidden, generator=g) * 0.02).to(dev, dt)
    samples = make_samples(a.samples, a.prompt, a.new, a.vocab, 5, a.hidden, g)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"device {name} ({str(dt)[6:]}); {a.samples} samples of {a.prompt}+{a.new} tokens; hidden {a.hidden}, "
          f"vocab {a.vocab}, drafter {a.draft_layers} layer(s), B={B}; budgets {BUDGETS} (K={K})")

    for d in iter_anchor_drafts(drafter, embed, head, samples[:1], B, topk=K):  # warm-up
        pass
    times = {}
    for label, k in (("chain only (lazy greedy drafts)", 0), (f"chain + all budgets (top-{K} log-probs)", K)):
        sync(dev)
        t0 = time.perf_counter()
        for d in iter_anchor_drafts(drafter, embed, head, samples, B, topk=k):
            if k:
                d.topk_logp.cpu(), d.topk_ids.cpu()  # what the walks read
        sync(dev)
        times[k] = (time.perf_counter() - t0) / a.samples
        print(f"drafter pass  {label:42s} {times[k]:8.4f} s/sample (batched all-anchor)")
    print(f"drafter pass  ratio all budgets / chain only: {times[K] / times[0]:.2f}x")

    walk = {"chain": 0.0, "shared": 0.0, "separate": 0.0}
    steps = {b: [] for b in BUDGETS}
    chain_steps = []
    for s in samples:
        x = s.input_ids.tolist()
        lp, ids = synthetic_drafts(x, a.prompt, B, K, a.hit, a.peak, g)
        t0 = time.perf_counter()
        chain_steps.append(chain_from_greedy(ids[..., 0], x, a.prompt, a.new, B))
        t1 = time.perf_counter()
        w = walk_budgets(lp, ids, x, a.prompt, a.new, B, BUDGETS)
        t2 = time.perf_counter()
        sep = per_budget_separately(lp, ids, x, a.prompt, a.new, B, BUDGETS)
        t3 = time.perf_counter()
        assert sep == w, "shared and separate walks disagree"
        walk["chain"] += t1 - t0
        walk["shared"] += t2 - t1
        walk["separate"] += t3 - t2
        for b in BUDGETS:
            steps[b].append(w[b])
    for k in walk:
        walk[k] /= a.samples
    print(f"walks (CPU)   chain                                      {walk['chain']:8.4f} s/sample")
    print(f"walks (CPU)   all budgets, shared heap per anchor        {walk['shared']:8.4f} s/sample")
    print(f"walks (CPU)   all budgets, one heap per budget           {walk['separate']:8.4f} s/sample "
          f"({walk['separate'] / walk['shared']:.2f}x the shared walk)")
    total_chain, total_tree = times[0] + walk["chain"], times[K] + walk["shared"]
    print(f"total         chain only {total_chain:.4f} s/sample; chain + all {len(BUDGETS)} budgets "
          f"{total_tree + walk['chain']:.4f} s/sample ({(total_tree + walk['chain']) / total_chain:.2f}x)")
    taus = {b: round(aggregate(steps[b], B).tau, 3) for b in BUDGETS}
    print(f"synthetic tau: chain {aggregate(chain_steps, B).tau:.3f}; DDTree {taus}")
    print(f"(per-anchor acceptance never decreases with the budget; synthetic hit={a.hit}, peak={a.peak})")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({
            "device": name, "dtype": str(dt)[6:], "samples": a.samples, "prompt": a.prompt, "new": a.new,
            "hidden": a.hidden, "vocab": a.vocab, "draft_layers": a.draft_layers, "block_size": B, "budgets": BUDGETS,
            "drafter_pass_s_per_sample": {"chain_only": times[0], "chain_and_all_budgets": times[K]},
            "walk_s_per_sample": walk, "synthetic_tau": {"chain": aggregate(chain_steps, B).tau, **taus}}, indent=1))
    if not math.isfinite(total_tree):
        sys.exit(1)


if __name__ == "__main__":
    main()
