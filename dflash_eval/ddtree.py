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
tokens), never the chain's; drafts exist for every anchor (:func:`anchor_drafts_reference`,
one drafter pass per anchor shared by all budgets), so each walk is a lookup.

Conventions shared with the chain replay (:mod:`dflash_eval.replay`, z-lab ``dflash==0.1.0``):
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
        one cut at the end of the response), the input of :func:`dflash_eval.metrics.aggregate`.

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


@dataclass
class AnchorDrafts:
    """Drafter output at every anchor of one sample (anchor ``t = prompt_len + i``, ``i < n_anchor``).

    ``greedy``: ``[n_anchor, B-1]`` int64 argmax drafts of slots 1..B-1; ``topk_logp`` / ``topk_ids``:
    ``[n_anchor, B-1, K]`` float32 full-vocabulary log-softmax values (descending) and int64 ids, or
    ``None`` when ``K = 0``. Slots at or past the shortened block's size hold drafts of masked slots
    and are never read.
    """

    greedy: torch.Tensor
    topk_logp: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None


@torch.inference_mode()
def anchor_drafts_reference(drafter, embed_weight: torch.Tensor, head_weight: torch.Tensor, sample,
                            block_size: int | None = None, topk: int = 0, chunk: int = 32) -> AnchorDrafts:
    """Drafts at every anchor ``t in [P, T-2]`` of one sample: the plain, slow reference producer.

    Each anchor's block ``[x[t], MASK x (B-1)]`` is drafted exactly as in the sequential replay
    (context = target states of positions ``< t``, block shortened to ``min(B, max_length - t)``),
    ``chunk`` anchors per drafter call over the whole sample's context. Memory per call:
    ``chunk x (B-1) x V`` float32 logits plus the context K/V of the sample.

    Args:
        drafter: :class:`~dflash_eval.drafter.DFlashDrafter` on the compute device/dtype.
        embed_weight, head_weight: target ``embed_tokens`` / ``lm_head`` ``[V, H]``.
        sample: :class:`~dflash_eval.cache.CacheSample` (``hidden`` = the drafter's layers, ``[T, K, H]``).
        block_size: B (default: the drafter's).
        topk: K top log-probs kept per slot (0 = greedy only).
        chunk: anchors per drafter call.

    Returns:
        :class:`AnchorDrafts` with ``n_anchor = max(T - 1 - P, 0)`` rows.
    """
    cfg = drafter.cfg
    B = int(block_size or cfg.block_size)
    dev, dt = embed_weight.device, embed_weight.dtype
    ids = sample.input_ids.to(dev)
    T, P = len(ids), int(sample.prompt_len)
    max_len = P + int(sample.max_new_tokens)
    n = max(T - 1 - P, 0)
    greedy = torch.empty(n, B - 1, dtype=torch.long, device=dev)
    k = min(int(topk), head_weight.shape[0])
    logp = torch.empty(n, B - 1, k, dtype=torch.float32, device=dev) if k else None
    top_ids = torch.empty(n, B - 1, k, dtype=torch.long, device=dev) if k else None
    if n == 0:
        return AnchorDrafts(greedy, logp, top_ids)
    hidden = sample.hidden.reshape(T, -1).to(device=dev, dtype=dt)[None]
    positions = torch.arange(T, device=dev)
    ctx_kv = drafter.context_kv(hidden, positions[None])
    slot = torch.arange(B, device=dev)
    for a0 in range(0, n, chunk):
        st = torch.arange(P + a0, P + min(a0 + chunk, n), device=dev)
        m = len(st)
        block_ids = torch.full((m, B), cfg.mask_token_id, dtype=torch.long, device=dev)
        block_ids[:, 0] = ids[st]
        emb = embed_weight[block_ids]
        if cfg.input_embedding_scale != 1.0:
            emb = emb * cfg.input_embedding_scale
        block_valid = slot[None] < torch.clamp(max_len - st, max=B)[:, None]
        kv = [(kk.expand(m, -1, -1, -1), vv.expand(m, -1, -1, -1)) for kk, vv in ctx_kv]
        h = drafter(emb, st[:, None] + slot[None], kv, positions[None].expand(m, -1), positions[None] < st[:, None],
                    block_valid)
        logits = drafter.logits(h[:, 1:], head_weight).float()
        rows = slice(a0, a0 + m)
        greedy[rows] = logits.argmax(-1)
        if k:
            lp, ti = torch.topk(torch.log_softmax(logits, dim=-1), k, dim=-1)
            logp[rows], top_ids[rows] = lp, ti
    return AnchorDrafts(greedy, logp, top_ids)


def chain_walk(greedy: torch.Tensor, input_ids: Sequence[int], prompt_len: int, max_new_tokens: int,
               block_size: int) -> list[int]:
    """Greedy DFlash chain acceptance from per-anchor drafts (the lookup form of the sequential replay).

    Args:
        greedy: ``[n_anchor, block_size - 1]`` argmax drafts per anchor (:class:`AnchorDrafts`).
        input_ids, prompt_len, max_new_tokens, block_size: as for :func:`walk_budgets`.

    Returns:
        per verify step committed tokens, as :func:`dflash_eval.replay.replay_batch` records them.
    """
    x = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
    g = greedy.tolist()
    T, P = len(x), int(prompt_len)
    max_len = P + int(max_new_tokens)
    t, out = P, []
    while t < T - 1:
        limit = min(min(block_size, max_len - t) - 1, T - 1 - t)
        a = 0
        while a < limit and g[t - P][a] == x[t + 1 + a]:
            a += 1
        produced = min(a + 1, T - 1 - t)
        out.append(produced)
        t += produced
    return out


def ddtree_replay(drafter, embed_weight: torch.Tensor, head_weight: torch.Tensor, sample, budgets: Sequence[int],
                  block_size: int | None = None) -> dict[int, list[int]]:
    """DDTree acceptance of one cached sample for every budget (one drafter pass per anchor, ``K = max(budgets)``).

    Returns:
        ``{budget: committed tokens per verify step}`` (see :func:`walk_budgets`).
    """
    B = int(block_size or drafter.cfg.block_size)
    drafts = anchor_drafts_reference(drafter, embed_weight, head_weight, sample, B, topk=max(budgets))
    return walk_budgets(drafts.topk_logp.cpu(), drafts.topk_ids.cpu(), sample.input_ids, sample.prompt_len,
                        sample.max_new_tokens, B, budgets)
