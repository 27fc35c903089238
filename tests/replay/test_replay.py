"""Replay on hand-built cases with known acceptance (against a hand computation), sequential and batched.

Every case runs through both replays (``mode``): the sequential reference (:func:`replay_batch`,
one drafter call per verify step) and the all-anchor replay (:func:`replay_batched`, every
anchor's block in packed drafter calls, then the chain walk); both must give the hand-computed
lists.
"""

from __future__ import annotations

import types

import pytest
import torch

from dflash_eval.cache.format import CacheSample
from dflash_eval.replay.anchors import anchor_drafts, chain_walk, replay_batched
from dflash_eval.drafter.model import DFlashDrafter
from dflash_eval.drafter.families import DFLASH
from dflash_eval.replay.chain import SampleResult, replay

MODES = ("sequential", "batched")

V = 50  # toy vocabulary; the "LM head" is the identity so drafter states are logits


class OracleDrafter:
    """Drafts the true continuation for the first ``k`` block slots after the anchor, then a wrong token.

    ``k`` may be a callable of the step's start index. Records every call's block validity so tests
    can check the shortened last block.
    """

    def __init__(self, seqs, k, block_size, mask_token_id=V - 1):
        self.seqs = seqs
        self.k = k
        self.cfg = types.SimpleNamespace(block_size=block_size, mask_token_id=mask_token_id,
                                         target_layer_ids=[0], hidden_size=1, input_embedding_scale=1.0,
                                         num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                                         head_dim=1, intermediate_size=1, layer_types=["full_attention"],
                                         is_causal=None)
        self.calls = []

    make_block = DFlashDrafter.make_block  # the block every replay builds: [anchor, MASK x (B-1)] embedded

    def context_kv(self, hidden, positions):
        return []

    family = DFLASH  # the replay asks the drafter's family (DFlash 1: each slot's argmax)

    def __call__(self, emb, block_pos, kv, ctx_pos, ctx_valid, block_valid, conv_segment=None):
        n, b = block_pos.shape
        out = torch.zeros(n, b, V)
        if ctx_valid.dim() == 3:  # batched replay, packed layout: blocks of B queries in one row
            B = self.cfg.block_size
            for r in range(n):
                for q in range(0, b, B):
                    self._draft(out[r, q : q + B], emb[r, q], int(block_pos[r, q]), int(ctx_valid[r, q].sum()),
                                int(block_valid[r, q].sum()))
            return out
        for r in range(n):
            self._draft(out[r], emb[r, 0], int(block_pos[r, 0]), int(ctx_valid[r].sum()), int(block_valid[r].sum()))
        return out

    def _draft(self, out, anchor_emb, start, n_ctx, n_valid):
        seq = self._seq_for(anchor_emb, start, n_ctx)
        k = self.k(start) if callable(self.k) else self.k
        for j in range(1, out.shape[0]):
            p = start + j
            true = seq[p] if p < len(seq) else 0
            out[j, true if j <= k else (true + 1) % (V - 1)] = 1.0
        self.calls.append((start, n_valid))

    def _seq_for(self, anchor_emb, start, n_ctx):
        # identify the sample by its committed prefix length and anchor token
        anchor = int(anchor_emb.argmax())
        cands = [s for s in self.seqs if start < len(s) and s[start] == anchor and n_ctx == start]
        return cands[0]

    def logits(self, h, head):
        return h @ head.T


def sample(seq, prompt_len, max_new_tokens):
    ids = torch.tensor(seq)
    return CacheSample(0, "s", ids, prompt_len, torch.zeros(len(seq), 1, 1), ids.clone(), "eos", max_new_tokens)


def run(seqs, prompt_lens, k, B, max_new=1000, mode="sequential"):
    drafter = OracleDrafter(seqs, k, B)
    eye = torch.eye(V)
    recs = replay(drafter, eye, eye, [sample(s, p, max_new) for s, p in zip(seqs, prompt_lens)], mode=mode)
    return recs, drafter


def seq_of(n, offset=0):
    return [(i * 7 + 3 + offset) % (V - 1) for i in range(n)]


@pytest.mark.parametrize("mode", MODES)
def test_right_for_exactly_k_tokens(mode):
    # prompt 5, completion 10 (x[5] from prefill, 9 tokens left); k=2 -> 3 tokens per step
    recs, _ = run([seq_of(15)], [5], k=2, B=4, mode=mode)
    assert recs == [[3, 3, 3]]
    r = SampleResult("s", 5, 10, recs[0])
    assert r.tau == 3.0


@pytest.mark.parametrize("mode", MODES)
def test_end_of_sequence_truncation(mode):
    # 10 tokens left after prefill with 3 per step: 3, 3, 3, then min(a+1, 1) = 1
    recs, _ = run([seq_of(16)], [5], k=2, B=4, mode=mode)
    assert recs == [[3, 3, 3, 1]]
    assert SampleResult("s", 5, 11, recs[0]).tau == pytest.approx(2.5)


@pytest.mark.parametrize("mode", MODES)
def test_always_wrong_gives_one_token_per_step(mode):
    recs, _ = run([seq_of(12)], [4], k=0, B=8, mode=mode)
    assert recs == [[1] * 7]


@pytest.mark.parametrize("mode", MODES)
def test_always_right_commits_full_blocks_and_cuts_last(mode):
    # 20 tokens left, B=8: 8, 8, then 4 (all drafts right, cut at the end of the completion)
    recs, _ = run([seq_of(26)], [5], k=99, B=8, mode=mode)
    assert recs == [[8, 8, 4]]


@pytest.mark.parametrize("mode", MODES)
def test_prefill_token_only_has_no_steps(mode):
    recs, _ = run([seq_of(6)], [5], k=3, B=4, mode=mode)
    assert recs == [[]]
    assert SampleResult("s", 5, 1, []).steps == 0


@pytest.mark.parametrize("mode", MODES)
def test_last_block_shortened_at_max_new_tokens(mode):
    # length-limited completion: max_new_tokens = 7, T = P + 7; vs = min(B, max_len - start)
    recs, drafter = run([seq_of(12)], [5], k=99, B=4, max_new=7, mode=mode)
    # start=5: vs=4 -> 4 tokens (start 9); start=9: vs=min(4, 12-9)=3, left=2 -> 2
    assert recs == [[4, 2]]
    if mode == "sequential":
        assert drafter.calls == [(5, 4), (9, 3)]
    else:  # every anchor 5..10 drafted once, with its own verify size min(4, 12 - t)
        assert sorted(drafter.calls) == [(5, 4), (6, 4), (7, 4), (8, 4), (9, 3), (10, 2)]


@pytest.mark.parametrize("mode", MODES)
def test_variable_acceptance_per_step(mode):
    # k depends on the step: 1 at start 5, 3 at start 7, 0 at start 11, 2 afterwards
    ks = {5: 1, 7: 3, 11: 0}
    recs, _ = run([seq_of(20)], [5], k=lambda s: ks.get(s, 2), B=4, mode=mode)
    # 5 ->(2) 7 ->(4) 11 ->(1) 12 ->(3) 15 ->(3) 18 ->(1: last token) 19
    assert recs == [[2, 4, 1, 3, 3, 1]]


@pytest.mark.parametrize("mode", MODES)
def test_batch_equals_one_by_one(mode):
    seqs = [seq_of(30, 0), seq_of(17, 1), seq_of(23, 2)]
    plens = [5, 3, 8]
    ks = lambda s: s % 3  # noqa: E731
    batched, _ = run(seqs, plens, ks, B=4, mode=mode)
    single = [run([s], [p], ks, B=4, mode=mode)[0][0] for s, p in zip(seqs, plens)]
    assert batched == single
    for rec, s, p in zip(batched, seqs, plens):
        assert sum(rec) == len(s) - 1 - p  # every completion token after the prefill one is committed once


@pytest.mark.parametrize("layout", ["rows", "packed", "groups"])
@pytest.mark.parametrize("memory_bytes", [1, 10_000, 10**9])
def test_chunking_does_not_change_the_result(memory_bytes, layout):
    # 1 byte: one anchor per drafter call; 10 kB: a few; 1 GB: everything in one packed call
    seqs = [seq_of(30, 0), seq_of(17, 1), seq_of(23, 2), seq_of(9, 3)]
    plens = [5, 3, 8, 2]
    ks = lambda s: (s * 5) % 4  # noqa: E731
    want, _ = run(seqs, plens, ks, B=4, mode="sequential")
    drafter = OracleDrafter(seqs, ks, 4)
    eye = torch.eye(V)
    stats = {}
    got = replay_batched(drafter, eye, eye, [sample(s, p, 1000) for s, p in zip(seqs, plens)],
                         memory_bytes=memory_bytes, layout=layout, stats=stats)
    assert got == want
    assert stats["query_tokens"] == 4 * sum(len(s) - 1 - p for s, p in zip(seqs, plens))  # every anchor once
    if memory_bytes == 1:
        assert stats["calls"] == sum(len(s) - 1 - p for s, p in zip(seqs, plens))
    if memory_bytes == 10**9:
        assert stats["calls"] == 1


def test_anchor_drafts_per_anchor_fields():
    # prompt 3, T = 12, max_new_tokens 9 (max_length 12): anchors 3..10
    seq = seq_of(12)
    ks = {3: 1, 4: 3, 5: 0, 6: 2, 7: 3, 8: 3, 9: 3, 10: 3}
    drafter = OracleDrafter([seq], lambda s: ks[s], 4)
    eye = torch.eye(V)
    d = anchor_drafts(drafter, eye, eye, sample(seq, 3, 9), topk=2)
    assert d.anchors.tolist() == list(range(3, 11))
    assert d.verify_size.tolist() == [4, 4, 4, 4, 4, 4, 3, 2]  # min(B, 12 - t)
    assert d.limit.tolist() == [3, 3, 3, 3, 3, 3, 2, 1]  # min(vs - 1, T - 1 - t)
    assert d.accepted.tolist() == [1, 3, 0, 2, 3, 3, 2, 1]  # min(k(t), limit)
    assert sorted(drafter.calls)[-2:] == [(9, 3), (10, 2)]  # the shortened blocks were drafted shortened
    assert d.greedy.shape == (8, 3) and d.greedy.dtype == torch.long
    assert d.greedy[0].tolist() == [seq[4], (seq[5] + 1) % (V - 1), (seq[6] + 1) % (V - 1)]
    assert d.topk_logp.shape == (8, 3, 2) and d.topk_logp.dtype == torch.float32
    assert torch.equal(d.topk_ids[..., 0], d.greedy)  # one-hot logits: the top-1 is the argmax
    top1 = torch.log(torch.tensor(torch.e / (torch.e + V - 1)))  # log-softmax of a one-hot logit row
    assert torch.allclose(d.topk_logp[..., 0], top1) and bool((d.topk_logp[..., 1] < top1).all())
    # 3 ->(a=1: 2) 5 ->(a=0: 1) 6 ->(a=2: 3) 9 ->(a=2, 2 tokens left: 2) 11
    assert chain_walk(d.accepted.tolist(), 3, 12) == [2, 1, 3, 2]


def test_chain_walk_by_hand():
    # P = 2, T = 10 (7 tokens to commit after the prefill token x[2])
    acc = [2, 0, 5, 1, 0, 3, 1]  # a(t) for t = 2..8
    # 2 ->(3) 5 ->(2) 7 ->(2: min(1+1, 9-7)) 9
    assert chain_walk(acc, 2, 10) == [3, 2, 2]
    assert chain_walk([], 4, 5) == []  # the prefill token ended the response


@pytest.mark.parametrize("queries", [4, 12, 20])
def test_groups_layout_pads_uneven_rows(queries, monkeypatch):
    # B = 4: 1, 3 and 5 anchors per row; pieces of 24, 13, 14, 6 anchors leave padded rows (their drafts dropped)
    import dflash_eval.replay.anchors as anchors_mod

    monkeypatch.setattr(anchors_mod, "GROUP_QUERIES", queries)
    seqs = [seq_of(30, 0), seq_of(17, 1), seq_of(23, 2), seq_of(9, 3)]
    plens = [5, 3, 8, 2]
    ks = lambda s: (s * 5) % 4  # noqa: E731
    want, _ = run(seqs, plens, ks, B=4, mode="sequential")
    eye = torch.eye(V)
    for memory_bytes in (10_000, 10**9):
        stats = {}
        got = replay_batched(OracleDrafter(seqs, ks, 4), eye, eye, [sample(s, p, 1000) for s, p in zip(seqs, plens)],
                             memory_bytes=memory_bytes, layout="groups", stats=stats)
        assert got == want
        n = sum(len(s) - 1 - p for s, p in zip(seqs, plens))
        assert stats["query_tokens"] == 4 * n
        assert stats["pad_query_tokens"] % 4 == 0 and (stats["pad_query_tokens"] > 0) == (queries > 4)


def test_repeat_heads_of_a_broadcast_context_equals_repeat_interleave():
    from dflash_eval.drafter.model import _repeat_heads

    base = torch.randn(1, 2, 5, 3)
    shared = base.expand(4, -1, -1, -1)  # the batched replay's one-sample context, stride 0 on dim 0
    got = _repeat_heads(shared, 3)
    assert got.shape == (4, 6, 5, 3) and got.stride(0) == 0
    assert torch.equal(got, shared.contiguous().repeat_interleave(3, dim=1))
    full = torch.randn(4, 2, 5, 3)
    assert torch.equal(_repeat_heads(full, 3), full.repeat_interleave(3, dim=1))


@pytest.mark.parametrize("rope", [
    {"rope_theta": 1000000},  # the common case: no transformers import
    {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    {"rope_theta": 1000000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 4096}},
    {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
])
def test_rotary_embedding_is_transformers_qwen3_bit_for_bit(rope):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from dflash_eval.drafter.rope import rotary_embedding
    from dflash_eval.drafter.config import DrafterConfig

    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 1,
           "num_target_layers": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 8192, "vocab_size": 100,
           "block_size": 4, "dflash_config": {"target_layer_ids": [1], "mask_token_id": 99, "block_size": 4}, **rope}
    cfg = DrafterConfig.from_dict(raw)
    mine, ref = rotary_embedding(cfg), Qwen3RotaryEmbedding(cfg.rotary_config())
    pos = torch.arange(0, 9000, 7)[None].repeat(2, 1)
    for dt in (torch.float32, torch.bfloat16):
        x = torch.zeros(1, dtype=dt)
        for a, b in zip(mine(x, pos), ref(x, pos)):
            assert a.dtype == dt and torch.equal(a, b)
