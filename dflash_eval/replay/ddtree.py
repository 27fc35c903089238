"""DDTree (Diffusion Draft Tree) acceptance, offline from the cache, for several node budgets at once.

DDTree (Ringel & Romano, "Accelerating Speculative Decoding with Block Diffusion Draft
Trees", arXiv:2604.12989; reference code ``liranringel/ddtree`` ``ddtree.py``) keeps the
DFlash drafter and changes what the target verifies: instead of the greedy chain, a tree
of the drafter's most probable prefixes, verified in one target forward with an
ancestor-only attention mask.

Tree (reference ``build_ddtree_tree``; paper Algorithm 1, Propositions 1-3):

* One drafter pass on ``[root, MASK x (vs-1)]`` gives per-slot distributions ``q_1 .. q_L``
  (slot ``j`` drafts the token at depth ``j``), ``L = vs - 1 <= block_size - 1``. Each slot's
  **full-vocabulary** log-softmax is kept for its top ``K`` tokens, descending.
* The **root** is the last committed token (the previous verify step's bonus token, not yet
  fed to the target); it is not counted in the budget.
* **Budget B** = number of drafted (non-root) nodes. The tree is the B highest-scoring
  prefixes, score of ``(u_1..u_d)`` = sum of ``log q_i(u_i)``, found best-first with a heap
  seeded with the rank-0 token at depth 1; popping a node pushes its next sibling (same
  parent, next rank) and its first child (next depth, rank 0). Heap key
  ``(-score, ranks tuple)``: equal scores pop in lexicographic order of the rank path, as
  the reference's ``heapq`` entries do. Nodes come out in pop order, parents first.
* Trees are nested: the budget-B tree is the first B pops of any larger budget's heap (a
  rank-r node needs its r elder siblings popped first, so ranks >= B never enter the first
  B pops; the reference's ``topk = min(budget, V)`` therefore changes nothing), so one heap
  run to the largest budget answers every budget, and ``K`` = the largest budget suffices
  (Lemma 1 of the paper).

Greedy verification (reference ``follow_verified_tree``): from the root, follow the child
whose token equals the target's argmax, while one exists. At temperature 0 the target's
argmax at a node depends only on the context and the node's ancestor path, which is the
cached greedy continuation wherever the path matches it, so the accepted depth is the
**deepest root path equal to a prefix of the continuation** (paper eq. 4) and needs no
target call. Per verify step the target commits that depth + 1 (the bonus token).

Trajectory: every budget walks its own anchors (next root = current root + committed
tokens), never the chain's; drafts exist for every anchor (the batched all-anchor pass
:func:`dflash_eval.replay.anchors.iter_anchor_drafts` with ``topk = max(budgets)``, one drafter pass per
anchor shared by the chain and all budgets, :func:`replay_with_trees`), so each walk is a lookup.

Conventions shared with the chain replay (:mod:`dflash_eval.replay.chain`, z-lab ``dflash==0.1.0``):
the block is shortened to ``vs = min(block_size, max_length - start)`` at the end of a
length-capped response (so depth <= vs - 1), and a step commits ``min(depth + 1, tokens
left)``. The ddtree reference always drafts a full block and counts the last step
uncut; the two differ only in the last steps of a response.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

import torch

from dflash_eval.core.errors import InputError
from dflash_eval.replay.anchors import chain_walk, iter_anchor_drafts


@dataclass
class DraftTree:
    """A draft tree in pop order. Node 0 is the root; node ``i >= 1`` is the ``i``-th pop.

    ``tokens[i-1]`` / ``depths[i-1]`` / ``ranks[i-1]``: token id, depth (1..L) and rank in its
    slot's top-K of node ``i``; ``parents[i]``: index of its parent (``parents[0] = -1``);
    ``children[i]``: ``{token: child index}`` (reference ``child_maps``).
    """

    tokens: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=lambda: [-1])
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])

    def __len__(self) -> int:
        """Number of drafted (non-root) nodes."""
        return len(self.tokens)

    def visibility(self) -> torch.Tensor:
        """Ancestor-or-self matrix ``[n+1, n+1]`` bool: row ``i`` is True at ``i`` and its ancestors (root included)."""
        n = len(self) + 1
        vis = torch.zeros(n, n, dtype=torch.bool)
        vis[0, 0] = True
        for i in range(1, n):
            vis[i] = vis[self.parents[i]]
            vis[i, i] = True
        return vis

    def follow(self, posterior: Sequence[int]) -> tuple[list[int], int]:
        """Greedy walk (reference ``follow_verified_tree``).

        Args:
            posterior: target argmax per verified row ``[n+1]`` (row 0 = root, row i = node i).

        Returns:
            ``(accepted, next_token)``: accepted node indices, root first, and the bonus token.
        """
        node, accepted = 0, [0]
        token = int(posterior[0])
        while token in self.children[node]:
            node = self.children[node][token]
            accepted.append(node)
            token = int(posterior[node])
        return accepted, token


def _heap_pops(logp: list[list[float]], budget: int, depth_limit: int):
    """Best-first pops as ``(parent, depth, rank)``, at most ``budget`` of them (see module docstring).

    ``logp[d][r]``: log-probability (python float) of rank ``r`` at depth ``d + 1``. Scores are
    accumulated as the reference does (sibling: ``s - lp[r] + lp[r+1]``; child: ``s + lp[0]``), so
    equal-score ties are the same ties.
    """
    if budget <= 0 or depth_limit <= 0 or not logp or not logp[0]:
        return
    topk = min(budget, len(logp[0]))
    first = logp[0][0]
    heap = [(-first, (0,), 0, 1, 0, first)]
    pops = 0
    while heap and pops < budget:
        _, ranks, parent, depth, rank, score = heapq.heappop(heap)
        pops += 1
        yield parent, depth, rank
        row = logp[depth - 1]
        if rank + 1 < topk:
            s = score - row[rank] + row[rank + 1]
            heapq.heappush(heap, (-s, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, s))
        if depth < depth_limit:
            s = score + logp[depth][0]
            heapq.heappush(heap, (-s, ranks + (0,), pops, depth + 1, 0, s))


def _as_lists(logp, token_ids, depth_limit):
    if isinstance(logp, torch.Tensor):
        logp = logp[:depth_limit].float().tolist()
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids[:depth_limit].tolist()
    return [list(map(float, r)) for r in logp[:depth_limit]], [list(map(int, r)) for r in token_ids[:depth_limit]]


def build_tree(logp, token_ids, budget: int, depth_limit: int | None = None) -> DraftTree:
    """The budget-``budget`` DDTree of one verify step (reference ``build_ddtree_tree``).

    Args:
        logp: ``[L, K]`` float top-K full-vocabulary log-softmax per slot, descending (tensor or nested lists);
            row ``d`` is depth ``d + 1``. Needs ``K >= min(budget, vocab)``.
        token_ids: ``[L, K]`` int token ids of those entries (distinct within a row).
        budget: number of drafted nodes B (``<= 0``: the root alone).
        depth_limit: maximum depth (default ``L``; the reference's ``block_size - 1``).

    Returns:
        :class:`DraftTree` with ``min(B, lattice size)`` nodes.
    """
    limit = len(logp) if depth_limit is None else min(depth_limit, len(logp))
    lp, ids = _as_lists(logp, token_ids, limit)
    tree = DraftTree()
    for parent, depth, rank in _heap_pops(lp, budget, limit):
        token = ids[depth - 1][rank]
        tree.tokens.append(token)
        tree.depths.append(depth)
        tree.ranks.append(rank)
        tree.parents.append(parent)
        tree.children.append({})
        tree.children[parent][token] = len(tree.tokens)
    return tree


def _depths_from_ranks(lp: list[list[float]], path_ranks: Sequence[int], budgets: Sequence[int]) -> list[int]:
    """Core of :func:`accepted_depths`: ``path_ranks[d]`` = rank of the continuation's token in slot ``d``'s
    top-K (-1 when absent), one entry per reachable depth; ``lp`` rows up to the depth limit."""
    bmax = max(budgets) if budgets else 0
    span = len(path_ranks)
    reach: list[int] = []  # reach[d-1] = pops until the depth-d prefix of the continuation was popped
    path_node = 0
    if span and 0 <= path_ranks[0] < bmax:
        for n, (parent, _, rank) in enumerate(_heap_pops(lp, bmax, len(lp)), 1):
            d = len(reach)
            if parent == path_node and rank == path_ranks[d]:  # a child of the path's end: depth d + 1
                reach.append(n)
                path_node = n
                if d + 1 >= span or not 0 <= path_ranks[d + 1] < bmax:
                    break  # no budget can accept deeper
    return [sum(1 for r in reach if r <= b) for b in budgets]


def accepted_depths(logp, token_ids, continuation: Sequence[int], budgets: Sequence[int],
                    depth_limit: int | None = None) -> list[int]:
    """Accepted depth of the budget-B tree for every B in ``budgets``, from one heap run.

    The accepted depth is the longest prefix of ``continuation`` that is a root path of the tree
    (greedy verification, reference ``follow_verified_tree``). The heap runs to ``max(budgets)``
    pops and stops early once the continuation's next token is not in the next slot's top-K
    (or the depth limit / the continuation's end is reached): no budget can accept deeper.

    Args:
        logp, token_ids: ``[L, K]`` as for :func:`build_tree` (``K >= min(max(budgets), vocab)``).
        continuation: the target's greedy tokens after the root, ``y_1, y_2, ...`` (any length).
        budgets: node budgets B (>= 0).
        depth_limit: maximum depth (default ``L``).

    Returns:
        accepted depths (0..depth limit), in the order of ``budgets``; the step commits depth + 1 tokens.
    """
    limit = len(logp) if depth_limit is None else min(depth_limit, len(logp))
    lp, ids = _as_lists(logp, token_ids, limit)
    ranks = []
    for d in range(min(limit, len(continuation))):
        row = ids[d]
        tok = int(continuation[d])
        ranks.append(row.index(tok) if tok in row else -1)
    return _depths_from_ranks(lp, ranks, budgets)


def walk_budgets(topk_logp: torch.Tensor, topk_ids: torch.Tensor, input_ids: Sequence[int], prompt_len: int,
                 max_new_tokens: int, block_size: int, budgets: Sequence[int]) -> dict[int, list[int]]:
    """Greedy DDTree decoding of one cached response for every budget, each on its own trajectory.

    Args:
        topk_logp: ``[n_anchor, block_size - 1, K]`` float, top-K full-vocabulary log-softmax per slot
            (descending) of the drafter's block at anchor ``t = prompt_len + i`` (``t`` = index of the
            last committed token, the root), ``n_anchor = T - 1 - prompt_len``; ``K >= max(budgets)``
            (or the vocabulary).
        topk_ids: ``[n_anchor, block_size - 1, K]`` int64 token ids of those entries.
        input_ids: the committed sequence, prompt + greedy completion, length ``T``.
        prompt_len: P; ``input_ids[P]`` is the prefill token (no verify step).
        max_new_tokens: generation limit of the response (``max_length = P + max_new_tokens``).
        block_size: drafter block size B.
        budgets: node budgets.

    Returns:
        ``{budget: per verify step committed tokens}`` (entries ``1..min(budget, B-1) + 1``, the last
        one cut at the end of the response), the input of :func:`dflash_eval.replay.metrics.aggregate`.

    Cost: one vectorised rank lookup of the continuation in every slot's top-K, then per visited
    anchor one heap run to the largest budget walking there (at most that many pops).
    """
    x = torch.as_tensor(input_ids).cpu()
    T, P = len(x), int(prompt_len)
    max_len = P + int(max_new_tokens)
    n = T - 1 - P
    out: dict[int, list[int]] = {b: [] for b in budgets}
    if n <= 0 or not budgets:
        return out
    # rank of the continuation's token x[t + j] in slot j's top-K, -1 when absent (or past the response)
    cont = torch.full((n, block_size - 1), -1, dtype=torch.long)
    for j in range(block_size - 1):
        m = max(min(n, T - (P + 1 + j)), 0)
        cont[:m, j] = x[P + 1 + j: P + 1 + j + m]
    ids = topk_ids[:n].cpu()
    hit = ids == cont[..., None]
    ranks = torch.where(hit.any(-1), hit.to(torch.int8).argmax(-1), -1).tolist()
    lp_all = topk_logp[:n].cpu().float().numpy()
    pos = {b: P for b in budgets}
    while True:
        live = [b for b in budgets if pos[b] < T - 1]
        if not live:
            return out
        t = min(pos[b] for b in live)  # every budget at this anchor shares one heap run
        group = [b for b in live if pos[b] == t]
        limit = min(block_size, max_len - t) - 1
        i = t - P
        span = min(limit, T - 1 - t)
        lp = lp_all[i, :limit, : max(group)].tolist()
        depths = _depths_from_ranks(lp, ranks[i][:span], group)
        for b, d in zip(group, depths):
            produced = min(d + 1, T - 1 - t)
            out[b].append(produced)
            pos[b] = t + produced


def chain_from_greedy(greedy: torch.Tensor, input_ids: Sequence[int], prompt_len: int, max_new_tokens: int,
                      block_size: int) -> list[int]:
    """Greedy DFlash chain acceptance from per-anchor argmax drafts (for hand-built drafts in tests and benches).

    Args:
        greedy: ``[n_anchor, block_size - 1]`` argmax drafts per anchor ``t = prompt_len + i``
            (:attr:`dflash_eval.replay.anchors.AnchorDrafts.greedy`, or rank 0 of hand-built top-K ids).
        input_ids, prompt_len, max_new_tokens, block_size: as for :func:`walk_budgets`.

    Returns:
        per verify step committed tokens, as :func:`dflash_eval.replay.chain.replay_batch` records them
        (the accepted prefix per anchor, then :func:`dflash_eval.replay.anchors.chain_walk`).
    """
    x = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
    g = greedy.tolist()
    T, P = len(x), int(prompt_len)
    max_len = P + int(max_new_tokens)
    accepted = []
    for t in range(P, T - 1):
        limit = min(min(block_size, max_len - t) - 1, T - 1 - t)
        a = 0
        while a < limit and g[t - P][a] == x[t + 1 + a]:
            a += 1
        accepted.append(a)
    return chain_walk(accepted, P, T)


def replay_with_trees(drafter, embed_weight: torch.Tensor, head_weight: torch.Tensor, samples: list,
                      budgets: Sequence[int], block_size: int | None = None, memory_bytes: int | None = None,
                      max_group_samples: int = 0, layout: str | None = None,
                      stats: dict | None = None) -> list[tuple[list[int], dict[int, list[int]]]]:
    """Chain and every DDTree budget of each sample from ONE all-anchor drafter pass.

    The pass is :func:`dflash_eval.replay.anchors.iter_anchor_drafts` with ``topk = max(budgets)``: every
    anchor's block is drafted once (memory bound stated there; the kept top-K costs
    ``(block_size - 1) * K * 12`` bytes per anchor), its argmax drafts give the chain's accepted
    prefix (:func:`dflash_eval.replay.anchors.chain_walk`) and its top-K log-probs every budget's tree
    (:func:`walk_budgets`, each budget on its own trajectory).

    Args:
        drafter, embed_weight, head_weight, samples, block_size, memory_bytes, max_group_samples, layout,
            stats: as for :func:`dflash_eval.replay.anchors.iter_anchor_drafts`.
        budgets: node budgets (>= 1; non-empty).

    Returns:
        per sample, in input order: ``(chain committed tokens per step, {budget: committed tokens per step})``.

    Raises:
        ValueError: no budget, or a budget < 1.
        InputError: a DFlash 2 drafter: its drafts are the selector's path, and no serving engine
            defines a tree over it (a tree over the per-slot marginals would be DFlash 1's tree of
            the same logits, not DFlash 2's); ``evaluate`` reports DDTree as not applicable.
    """
    if not drafter.family.ddtree_applicable:
        label = drafter.family.label
        raise InputError(None, "evaluate.ddtree_budgets", f"DDTree is not defined for {label} drafters (the serving "
                         "engines draft one candidate-selector path per verify step)",
                         f"evaluate {label} drafters in chain mode (their DDTree columns are NaN)")
    budgets = sorted({int(b) for b in budgets})
    if not budgets or budgets[0] < 1:
        raise ValueError(f"DDTree budgets {budgets}: need at least one budget, all >= 1")
    B = int(block_size or drafter.cfg.block_size)
    out = []
    for s, d in zip(samples, iter_anchor_drafts(drafter, embed_weight, head_weight, samples, B, topk=budgets[-1],
                                                memory_bytes=memory_bytes, max_group_samples=max_group_samples,
                                                layout=layout, stats=stats)):
        chain = chain_walk(d.accepted.tolist(), d.prompt_len, d.n_tokens)
        if d.topk_logp is None or len(d.anchors) == 0:
            trees = {b: [] for b in budgets}
        else:
            trees = walk_budgets(d.topk_logp.cpu(), d.topk_ids.cpu(), s.input_ids, s.prompt_len, s.max_new_tokens,
                                 B, budgets)
        out.append((chain, trees))
    return out
