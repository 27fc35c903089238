"""How one drafter call of the batched all-anchor pass holds its anchors' blocks (the layouts of
:data:`dflash_eval.replay.anchors.LAYOUTS`; sizes and the mask convention: :func:`dflash_eval.replay.anchors.iter_anchor_drafts`).

Each function takes one chunk of consecutive anchors (``pieces``: ``(sample, a0, a1)`` ranges) of
a group whose samples are concatenated (flat ``ids``, offsets ``off``, per-layer context K/V
``ctx_kv`` ``[1, n_kv, sum T, hd]``) and returns the drafter states ``[C, B, H]`` of its anchors.
"""

from __future__ import annotations

import torch


def rows_forward(drafter, embed, ids, ctx_kv, off, pieces, anchors, base, vs, B: int):
    """``rows`` layout: drafter states ``[C, B, H]``, one row per anchor over its sample's first ``Kc`` keys
    (``Kc`` = the chunk's largest anchor); returns ``(h, Kc)``."""
    dev = embed.device
    Kc = max(a1 - 1 for _, _, a1 in pieces)
    if len(pieces) == 1:  # one sample: its context, shared by every row (no copy until the drafter's cat)
        i = pieces[0][0]
        kv = [(k[:, :, off[i] : off[i] + Kc].expand(len(anchors), -1, -1, -1),
               v[:, :, off[i] : off[i] + Kc].expand(len(anchors), -1, -1, -1)) for k, v in ctx_kv]
    else:  # several samples: each row gathers its own sample's first Kc keys (the tail is masked)
        idx = (base[:, None] + torch.arange(Kc, device=dev)[None]).clamp(max=off[-1] - 1)
        kv = [(k[0][:, idx].transpose(0, 1), v[0][:, idx].transpose(0, 1)) for k, v in ctx_kv]
    return block_forward(drafter, embed, ids[base + anchors], anchors, kv, Kc, vs, B), Kc


def packed_forward(drafter, embed, ids, pos, ctx_kv, off, pieces, owner, anchors, base, vs, B: int):
    """``packed`` layout: drafter states ``[C, B, H]`` from one sequence of ``C*B`` queries over the keys
    ``[each piece's sample context < its largest anchor | all blocks]``; returns ``(h, context keys)``."""
    dev = embed.device
    C = len(anchors)
    if len(pieces) == 1:
        i, _, a1 = pieces[0]
        key_idx = slice(off[i], off[i] + a1 - 1)
        key_owner = torch.full((a1 - 1,), i, dtype=torch.long, device=dev)
    else:
        key_idx = torch.cat([torch.arange(off[i], off[i] + a1 - 1, device=dev) for i, _, a1 in pieces])
        key_owner = torch.cat([torch.full((a1 - 1,), i, dtype=torch.long, device=dev) for i, _, a1 in pieces])
    key_pos = pos[key_idx]
    kv = [(k[:, :, key_idx], v[:, :, key_idx]) for k, v in ctx_kv]
    slot = torch.arange(B, device=dev)
    emb = drafter.make_block(ids[base + anchors], embed, B).reshape(1, C * B, -1)
    ctx_valid = (key_owner[None, :] == owner[:, None]) & (key_pos[None, :] < anchors[:, None])  # [C, Kc]
    row = torch.arange(C * B, device=dev) // B
    block_valid = (row[:, None] == row[None, :]) & (slot.repeat(C)[None, :] < vs[row][:, None])  # [C*B, C*B]
    h = drafter(emb, (anchors[:, None] + slot[None]).reshape(1, C * B), kv, key_pos[None],
                ctx_valid.repeat_interleave(B, dim=0)[None], block_valid[None],
                conv_segment=B)  # several blocks per row: a family's conv restarts per block (others ignore it)
    return h.view(C, B, -1), len(key_pos)


def groups_forward(drafter, embed, ids, ctx_kv, off, pieces, anchors, base, vs, B: int, g: int):
    """``groups`` layout: drafter states ``[C, B, H]``, ``g`` consecutive anchors of one sample per row.

    A row holds ``g*B`` queries over the keys ``[its sample's context [0, Kc) | its g blocks]``
    (``Kc`` = the chunk's largest anchor); query ``(a, j)`` sees the context before anchor ``a``
    and the slots ``< vs(a)`` of its own block only (per-query masks, as ``packed``), so the drafts
    are those of ``rows`` up to reduction order while the context K/V is copied once per row of
    ``g`` anchors (one sample: not at all until the drafter's concatenation). A piece whose anchor
    count is not a multiple of ``g`` repeats its last anchor in the padding slots (computed, dropped).
    Returns ``(h, Kc, rows)``.
    """
    dev = embed.device
    Kc = max(a1 - 1 for _, _, a1 in pieces)
    take, real, r0 = [], [], 0  # per row, indices into the chunk's anchors (padded with the piece's last one)
    for _, a0, a1 in pieces:
        n = a1 - a0
        idx = torch.arange(r0, r0 + -(-n // g) * g, device=dev)
        take.append(idx.clamp(max=r0 + n - 1))
        real.append(idx < r0 + n)
        r0 += n
    take, real = torch.cat(take), torch.cat(real)  # [R*g]
    R = len(take) // g
    a, own_vs = anchors[take], vs[take]
    row_base = base[take].view(R, g)[:, 0]
    if len(pieces) == 1:
        i = pieces[0][0]
        kv = [(k[:, :, off[i] : off[i] + Kc].expand(R, -1, -1, -1), v[:, :, off[i] : off[i] + Kc].expand(R, -1, -1, -1))
              for k, v in ctx_kv]
    else:
        kidx = (row_base[:, None] + torch.arange(Kc, device=dev)[None]).clamp(max=off[-1] - 1)
        kv = [(k[0][:, kidx].transpose(0, 1), v[0][:, kidx].transpose(0, 1)) for k, v in ctx_kv]
    slot = torch.arange(B, device=dev)
    emb = drafter.make_block(ids[base[take] + a], embed, B).reshape(R, g * B, -1)
    ctx_pos = torch.arange(Kc, device=dev)
    ctx_valid = (ctx_pos[None, None] < a.view(R, g)[:, :, None])  # [R, g, Kc]
    ctx_valid = ctx_valid[:, :, None].expand(R, g, B, Kc).reshape(R, g * B, Kc)
    blk = torch.arange(g * B, device=dev) // B  # each query's / key's block within the row
    blk_valid = (blk[None, :, None] == blk[None, None, :]) & (slot.repeat(g)[None, None, :]
                                                                < own_vs.view(R, g).repeat_interleave(B, 1)[:, :, None])
    h = drafter(emb, (a[:, None] + slot[None]).view(R, g * B), kv, ctx_pos[None].expand(R, -1), ctx_valid, blk_valid,
                conv_segment=B)  # several blocks per row: a family's conv restarts per block (others ignore it)
    return h.view(R * g, B, -1)[real], Kc, R


def block_forward(drafter, embed, anchor_ids, anchors, kv, Kc: int, vs, B: int):
    """Drafter states ``[C, B, H]`` of the blocks at ``anchors`` ``[C]`` (anchor tokens ``anchor_ids``,
    verify sizes ``vs``), over per-row context K/V ``[C, n_kv, Kc, hd]`` of positions ``0..Kc-1``."""
    dev = embed.device
    C = len(anchors)
    slot = torch.arange(B, device=dev)
    emb = drafter.make_block(anchor_ids, embed, B)
    ctx_pos = torch.arange(Kc, device=dev)[None].expand(C, -1)
    return drafter(emb, anchors[:, None] + slot[None], kv, ctx_pos, ctx_pos < anchors[:, None], slot[None] < vs[:, None])
