"""Acceptance lengths recomputed by hand from a hidden-state cache, independently of the package's replay.

What the pinned-tau tests compare the workflow's ``tau.csv`` and per-sample eval JSON with. Nothing here
calls :mod:`dflash_eval.replay.chain`, :mod:`dflash_eval.replay.ddtree`, :mod:`dflash_eval.replay.metrics` or the cache reader:

* the cache is read with ``h5py`` (layout: ``docs/cache-format.md``, version 3, float32);
* per anchor ``t`` (the last committed token, ``P <= t <= T-2``) the drafter (``DFlashDrafter``) runs
  **one block at a time**, as the reference decode loop does (z-lab/dflash ``dflash/model.py``
  ``dflash_generate``): context = the cached target states of positions ``< t``, block
  ``[x[t], MASK x (vs-1)]`` at positions ``t .. t+vs-1`` with the verify size ``vs = min(B, max_length - t)``
  (the reference's shortened last block: a *shorter block*, where the replay masks slots), drafted logits
  ``= norm(h) @ lm_head^T`` of the target;
* the greedy chain: accept the longest prefix of argmax drafts equal to the cached continuation, commit
  ``min(a + 1, tokens left)`` (``dflash_generate``'s ``produced``), move the anchor by that much;
* DDTree (Ringel & Romano, arXiv:2604.12989, reference ``liranringel/ddtree``): the budget-``b`` tree is
  the ``b`` best prefixes of the per-slot top-``b`` lattice by summed full-vocabulary log-probability
  (ties: the lexicographically smaller rank path first), found here by enumerating every prefix and
  sorting, not by a heap; the accepted depth is the longest continuation prefix in the tree; each budget
  walks its own anchors;
* tau as the reference benchmark defines it (z-lab/dflash ``dflash/benchmark.py``
  ``_print_decode_summary``): per response the mean of the committed tokens per verify step, then the
  mean over responses.
"""

from __future__ import annotations

import io
import itertools
import json
import statistics
from contextlib import redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import torch


def read_cache(path: Path, layer_ids: list[int]) -> list[dict]:
    """Samples of a float32 cache file: ``id``, ``x`` (prompt + completion ids, list), ``P``, ``max_new``,
    ``hidden`` ``[T, K*H]`` float32 (the layers ``layer_ids`` in that order)."""
    import h5py

    with h5py.File(path, "r") as f:
        assert f.attrs["format_version"] in (3, 4, 5, 6) and f.attrs["dtype"] == "float32", dict(f.attrs)
        stored = [int(i) for i in f.attrs["target_layer_ids"]]
        cols = [stored.index(i) for i in layer_ids]
        out = []
        for i, sid in enumerate(f["sample_ids"][()]):
            g = f[f"samples/{i:06d}"]
            hidden = torch.from_numpy(g["hidden"][()][:, cols]).float()
            out.append({"id": sid.decode() if isinstance(sid, bytes) else str(sid),
                        "x": [int(v) for v in g["input_ids"][()]], "P": int(f["prompt_len"][i]),
                        "max_new": int(f["max_new_tokens"][i]), "hidden": hidden.reshape(hidden.shape[0], -1)})
    return out


def load(drafter_dir: Path, target_dir: Path):
    """(drafter in float32, config dict, target embedding ``[V, H]``, target LM head ``[V, H]``), float32."""
    from safetensors.torch import load_file

    from dflash_eval.drafter.model import DFlashDrafter, DrafterConfig

    cfg = json.loads((drafter_dir / "config.json").read_text())
    drafter = DFlashDrafter(DrafterConfig.from_dict(cfg))
    drafter.load_state_dict(load_file(str(drafter_dir / "model.safetensors")), strict=True)
    drafter = drafter.float().eval()
    # plain logits below: no output multiplier, softcap or input scale on this drafter
    assert drafter.cfg.output_multiplier == 1.0 and not drafter.cfg.final_logit_softcapping
    assert drafter.cfg.input_embedding_scale == 1.0
    weights = load_file(str(target_dir / "model.safetensors"))
    return drafter, cfg, weights["model.embed_tokens.weight"].float(), weights["lm_head.weight"].float()


@torch.inference_mode()
def block_logits(drafter, embed, head, s: dict, t: int, B: int, mask_id: int) -> torch.Tensor:
    """Drafted logits ``[vs - 1, V]`` of the block at anchor ``t`` (row ``j - 1`` drafts ``x[t + j]``)."""
    vs = min(B, s["P"] + s["max_new"] - t)
    ctx_pos = torch.arange(t)[None]
    kv = drafter.context_kv(s["hidden"][None, :t], ctx_pos)
    block = torch.tensor([[s["x"][t]] + [mask_id] * (vs - 1)])
    h = drafter(embed[block], torch.arange(t, t + vs)[None], kv, ctx_pos, torch.ones(1, t, dtype=torch.bool))
    return h[0, 1:] @ head.T


def chain(drafts: dict[int, list[int]], s: dict) -> list[int]:
    """Greedy chain from the argmax drafts per anchor: per verify step ``min(a + 1, tokens left)``."""
    x, T, start, steps = s["x"], len(s["x"]), s["P"], []
    while start < T - 1:
        d, a = drafts[start], 0
        while a < len(d) and start + 1 + a < T and d[a] == x[start + 1 + a]:
            a += 1
        produced = min(a + 1, T - 1 - start)
        steps.append(produced)
        start += produced
    return steps


def tree_depth(logp: torch.Tensor, x: list[int], t: int, budget: int) -> int:
    """Accepted depth of the budget-``budget`` DDTree at anchor ``t`` (``logp``: ``[L, V]`` float32 log-softmax)."""
    L = logp.shape[0]
    top = [torch.topk(logp[d], min(budget, logp.shape[1])) for d in range(L)]
    vals = [v.tolist() for v, _ in top]
    ids = [i.tolist() for _, i in top]
    nodes = [path for d in range(1, L + 1) for path in itertools.product(range(len(vals[0])), repeat=d)]
    nodes.sort(key=lambda p: (-sum(vals[d][r] for d, r in enumerate(p)), p))
    tree = {tuple(ids[d][r] for d, r in enumerate(p)) for p in nodes[:budget]}
    depth = 0
    while depth < L and t + 1 + depth < len(x) and tuple(x[t + 1: t + 2 + depth]) in tree:
        depth += 1
    return depth


def ddtree(logps: dict[int, torch.Tensor], s: dict, budget: int) -> list[int]:
    """DDTree steps of one response for one budget, on its own trajectory."""
    x, T, start, steps = s["x"], len(s["x"]), s["P"], []
    while start < T - 1:
        produced = min(tree_depth(logps[start], x, start, budget) + 1, T - 1 - start)
        steps.append(produced)
        start += produced
    return steps


def recompute(drafter_dir: Path, target_dir: Path, cache_path: Path, budgets: list[int]) -> list[dict]:
    """Per cached sample: ``id``, ``chain`` (committed tokens per verify step), ``ddtree`` (``{"<b>": steps}``)
    and ``min_gap``: the smallest top-1 minus top-2 logit gap of the argmax drafts the chain compared (a
    decision this close could round the other way in the replay's batched arithmetic)."""
    drafter, cfg, embed, head = load(Path(drafter_dir), Path(target_dir))
    B, mask_id = int(cfg["dflash_config"]["block_size"]), int(cfg["dflash_config"]["mask_token_id"])
    out = []
    for s in read_cache(Path(cache_path), list(cfg["dflash_config"]["target_layer_ids"])):
        logits = {t: block_logits(drafter, embed, head, s, t, B, mask_id) for t in range(s["P"], len(s["x"]) - 1)}
        drafts = {t: lg.argmax(-1).tolist() for t, lg in logits.items()}
        steps = chain(drafts, s)
        gaps, start = [], s["P"]
        for n in steps:  # the slots compared at each visited anchor: 1..n (n-th refused unless cut)
            top2 = torch.topk(logits[start][: min(n, len(drafts[start]))], 2, dim=-1).values
            gaps += (top2[:, 0] - top2[:, 1]).tolist()
            start += n
        logps = {t: lg.log_softmax(-1) for t, lg in logits.items()}
        out.append({"id": s["id"], "chain": steps, "ddtree": {str(b): ddtree(logps, s, b) for b in budgets},
                    "min_gap": min(gaps) if gaps else float("inf")})
    return out


def reference_tau(per_response: list[list[int]]) -> float:
    """tau by the reference definition: mean over responses of the per-response mean (responses with steps)."""
    return statistics.mean(statistics.mean(r) for r in per_response if r)


def reference_printed_tau(per_response: list[list[int]], block_size: int) -> str:
    """What the reference benchmark itself prints as "Average Acceptance length" for these responses (2 decimals;
    ``dflash==0.1.0`` ``dflash/benchmark.py`` ``_print_decode_summary``, fed the acceptance lists)."""
    from dflash.benchmark import _print_decode_summary

    responses = [{1: SimpleNamespace(time_per_output_token=1.0),
                  block_size: SimpleNamespace(time_per_output_token=1.0, acceptance_lengths=r)} for r in per_response]
    buf = io.StringIO()
    with redirect_stdout(buf):
        _print_decode_summary(responses, block_size)
    line = next(x for x in buf.getvalue().splitlines() if x.startswith("Average Acceptance length:"))
    return line.split(":", 1)[1].strip()
