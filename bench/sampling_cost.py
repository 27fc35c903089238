#!/usr/bin/env python
"""Cost of evaluating every sampling setting against greedy alone, on the same samples and drafter.

``evaluate`` computes every ``evaluate.sampling`` setting from the one all-anchor drafter pass that also
gives the chain and every DDTree budget (:func:`dflash_eval.stages.evaluate._sampled_pass`): the extra
work of a setting with temperature > 0 is the target's probability of each cached token (one LM-head row
per token from the cached final hidden state, :func:`dflash_eval.replay.expected.target_token_probs`), the
drafter's full-vocabulary LM head at every slot of every anchor with the setting's filter
(:func:`dflash_eval.replay.expected.chain_survival`) and the walk DP (:func:`dflash_eval.replay.expected.response_expectations`).
Timed here, each the fastest of ``--repeats`` (one warm-up first):

- ``chain``: greedy chain only (``evaluate.ddtree_budgets: []``; the lazy LM head, slot by slot);
- ``greedy``: greedy chain + DDTree budgets (``--budgets``, the default ``evaluate`` run at T = 0);
- ``chain+T``: chain + the settings (no DDTree);
- ``all``: chain + DDTree budgets + the settings (``[T0, T1 top-p 0.95 top-k 20]`` by default).

Printed: seconds of each, the ratios ``all / greedy`` and ``chain+T / chain`` (goal <= 1.5x), and the
expected tau per setting next to the greedy tau (random weights: tau ~1, the timings do not depend on it).
Case: the random llama-style target of ``bench/replay.py`` (``BIG``: hidden 2048, vocab 128256) with a
random 1-layer drafter, B = 16, 5 stored layers + the final hidden state, random hidden states and ids
(the cost does not depend on their values). On one H200, from the repository root (~2 min):

    python bench/sampling_cost.py

CPU smoke run (tiny sizes, float32; checks the script, not speed): ``.venv/bin/python bench/sampling_cost.py --smoke``
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402

from replay import BIG, TINY, drafter_config, sync  # noqa: E402

from dflash_eval.replay.anchors import chain_walk, iter_anchor_drafts, replay_batched  # noqa: E402
from dflash_eval.cache.format import CacheSample  # noqa: E402
from dflash_eval.replay.ddtree import replay_with_trees, walk_budgets  # noqa: E402
from dflash_eval.drafter.model import DFlashDrafter  # noqa: E402
from dflash_eval.drafter.config import DrafterConfig  # noqa: E402
from dflash_eval.replay.expected import response_expectations, target_token_probs  # noqa: E402
from dflash_eval.replay.metrics import aggregate, aggregate_expected  # noqa: E402
from dflash_eval.replay.sampling import SamplingSetting  # noqa: E402

print = functools.partial(print, flush=True)  # noqa: A001


def build(args, dev, dt):
    """Random drafter, embed/head, samples (drafter layers) and final hidden states."""
    tcfg = TINY if args.smoke else BIG
    n_layers = tcfg["num_hidden_layers"]
    layer_ids = sorted({round(1 + i * (n_layers - 3) / 4) for i in range(5)})
    torch.manual_seed(2)
    drafter = DFlashDrafter(DrafterConfig.from_dict(drafter_config(tcfg, 1, args.block_size, layer_ids)))
    drafter = drafter.to(device=dev, dtype=dt).eval()
    gen = torch.Generator().manual_seed(3)
    V, H = tcfg["vocab_size"], tcfg["hidden_size"]
    embed = (torch.randn(V, H, generator=gen) * 0.02).to(device=dev, dtype=dt)
    head = (torch.randn(V, H, generator=gen) * 0.02).to(device=dev, dtype=dt)
    samples, finals = [], []
    P, N = args.prompt, args.new
    for i in range(args.n):
        ids = torch.randint(0, V - 1, (P + N,), generator=gen)
        hidden = torch.randn(P + N, len(layer_ids), H, generator=gen).to(dt)
        samples.append(CacheSample(i, f"r{i}", ids, P, hidden, ids.clone(), "length", N))
        finals.append(torch.randn(P + N, H, generator=gen).to(dt))
    return drafter, embed, head, samples, finals


def run_all(drafter, embed, head, samples, finals, settings, budgets, B, dev):
    """What evaluate's sampled pass does: p per setting, one all-anchor pass, chain + trees + expectations."""
    p_tokens = [target_token_probs(f.to(dev), head, s.input_ids, settings) for s, f in zip(samples, finals)]
    chains, exps = [], {st.label: [] for st in settings}
    for s, d in zip(samples, iter_anchor_drafts(drafter, embed, head, samples, B, topk=max(budgets, default=0),
                                                sampling=settings, p_tokens=p_tokens)):
        chains.append(chain_walk(d.accepted.tolist(), d.prompt_len, d.n_tokens))
        if budgets:
            walk_budgets(d.topk_logp.cpu(), d.topk_ids.cpu(), s.input_ids, s.prompt_len, s.max_new_tokens, B, budgets)
        for st in settings:
            exps[st.label] += response_expectations([d.survival[st.label].cpu()], [d.prompt_len], [d.n_tokens], B)
    return chains, exps


def best_of(fn, repeats: int, dev) -> tuple[float, object]:
    fn()  # warm-up
    best, out = float("inf"), None
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        out = fn()
        sync(dev)
        best = min(best, time.perf_counter() - t0)
    return best, out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, float32")
    ap.add_argument("--n", type=int, default=8, help="samples")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per sample")
    ap.add_argument("--new", type=int, default=1024, help="completion tokens per sample")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budgets", default="8,16,32,64,128,256", help="DDTree budgets ('' = none)")
    ap.add_argument("--settings", default='[{"temperature": 1.0, "top_p": 0.95, "top_k": 20}]',
                    help="JSON list of the settings with temperature > 0 evaluated beside T0")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    import json

    if args.smoke:
        args.n, args.prompt, args.new, args.block_size = min(args.n, 2), 8, 24, 4
        args.budgets = args.budgets if args.budgets != ap.get_default("budgets") else "2,8"
    dev = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dt = torch.float32 if dev.type == "cpu" else torch.bfloat16
    settings = [SamplingSetting(**s) for s in json.loads(args.settings)]
    if any(s.greedy for s in settings):
        ap.error("--settings lists the temperature > 0 settings only (T0 is always evaluated)")
    budgets = [int(b) for b in args.budgets.split(",") if b]
    drafter, embed, head, samples, finals = build(args, dev, dt)
    B = args.block_size
    tokens = sum(len(s.input_ids) - s.prompt_len for s in samples)
    print(f"# {len(samples)} samples x ({args.prompt} + {args.new}) tokens, B = {B}, V = {head.shape[0]}, "
          f"H = {head.shape[1]}, {dev.type} {str(dt).split('.')[-1]}, budgets {budgets}, settings "
          f"{[s.label for s in settings]}")
    t_chain, chain = best_of(lambda: replay_batched(drafter, embed, head, samples, B), args.repeats, dev)
    t_greedy = best_of(lambda: replay_with_trees(drafter, embed, head, samples, budgets, B), args.repeats, dev)[0] \
        if budgets else t_chain
    t_chain_t, (chains_t, _) = best_of(lambda: run_all(drafter, embed, head, samples, finals, settings, [], B, dev),
                                       args.repeats, dev)
    t_all, (chains, exps) = best_of(lambda: run_all(drafter, embed, head, samples, finals, settings, budgets, B, dev),
                                    args.repeats, dev)
    assert chains == chain == chains_t, "the sampled pass changed the greedy chain"
    print(f"  chain {t_chain:.3f} s; greedy (chain + DDTree) {t_greedy:.3f} s; chain + settings {t_chain_t:.3f} s; "
          f"all (chain + DDTree + settings) {t_all:.3f} s ({tokens / t_all:,.0f} completion tok/s)")
    print(f"  cost: all / greedy {t_all / t_greedy:.2f}x; chain + settings / chain {t_chain_t / t_chain:.2f}x "
          f"(goal <= 1.5x)")
    taus = {label: aggregate_expected(e, B, [s.prompt_len for s in samples]).tau for label, e in exps.items()}
    print(f"  tau: T0 {aggregate(chain, B).tau:.4f}; " + "; ".join(f"{k} {v:.4f} (expected)" for k, v in taus.items()))


if __name__ == "__main__":
    main()
