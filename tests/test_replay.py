"""Replay on hand-built cases with known acceptance (against a hand computation)."""

from __future__ import annotations

import types

import pytest
import torch

from dflash_eval.cache import CacheSample
from dflash_eval.replay import SampleResult, replay_batch

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
                                         target_layer_ids=[0], hidden_size=1, input_embedding_scale=1.0)
        self.calls = []

    def context_kv(self, hidden, positions):
        return []

    def __call__(self, emb, block_pos, kv, ctx_pos, ctx_valid, block_valid):
        n, b = block_pos.shape
        out = torch.zeros(n, b, V)
        for r in range(n):
            start = int(block_pos[r, 0])
            seq = self._seq_for(emb[r, 0], start, ctx_valid[r])
            k = self.k(start) if callable(self.k) else self.k
            for j in range(1, b):
                p = start + j
                true = seq[p] if p < len(seq) else 0
                out[r, j, true if j <= k else (true + 1) % (V - 1)] = 1.0
            self.calls.append((start, int(block_valid[r].sum())))
        return out

    def _seq_for(self, anchor_emb, start, ctx_valid):
        # identify the sample by its committed prefix length and anchor token
        anchor = int(anchor_emb.argmax())
        cands = [s for s in self.seqs if start < len(s) and s[start] == anchor and int(ctx_valid.sum()) == start]
        return cands[0]

    def logits(self, h, head):
        return h @ head.T


def sample(seq, prompt_len, max_new_tokens):
    ids = torch.tensor(seq)
    return CacheSample(0, "s", ids, prompt_len, torch.zeros(len(seq), 1, 1), ids.clone(), "eos", max_new_tokens)


def run(seqs, prompt_lens, k, B, max_new=1000):
    drafter = OracleDrafter(seqs, k, B)
    eye = torch.eye(V)
    recs = replay_batch(drafter, eye, eye, [sample(s, p, max_new) for s, p in zip(seqs, prompt_lens)])
    return recs, drafter


def seq_of(n, offset=0):
    return [(i * 7 + 3 + offset) % (V - 1) for i in range(n)]


def test_right_for_exactly_k_tokens():
    # prompt 5, completion 10 (x[5] from prefill, 9 tokens left); k=2 -> 3 tokens per step
    recs, _ = run([seq_of(15)], [5], k=2, B=4)
    assert recs == [[3, 3, 3]]
    r = SampleResult("s", 5, 10, recs[0])
    assert r.tau == 3.0


def test_end_of_sequence_truncation():
    # 10 tokens left after prefill with 3 per step: 3, 3, 3, then min(a+1, 1) = 1
    recs, _ = run([seq_of(16)], [5], k=2, B=4)
    assert recs == [[3, 3, 3, 1]]
    assert SampleResult("s", 5, 11, recs[0]).tau == pytest.approx(2.5)


def test_always_wrong_gives_one_token_per_step():
    recs, _ = run([seq_of(12)], [4], k=0, B=8)
    assert recs == [[1] * 7]


def test_always_right_commits_full_blocks_and_cuts_last():
    # 20 tokens left, B=8: 8, 8, then 4 (all drafts right, cut at the end of the completion)
    recs, _ = run([seq_of(26)], [5], k=99, B=8)
    assert recs == [[8, 8, 4]]


def test_prefill_token_only_has_no_steps():
    recs, _ = run([seq_of(6)], [5], k=3, B=4)
    assert recs == [[]]
    assert SampleResult("s", 5, 1, []).steps == 0


def test_last_block_shortened_at_max_new_tokens():
    # length-limited completion: max_new_tokens = 7, T = P + 7; vs = min(B, max_len - start)
    recs, drafter = run([seq_of(12)], [5], k=99, B=4, max_new=7)
    # start=5: vs=4 -> 4 tokens (start 9); start=9: vs=min(4, 12-9)=3, left=2 -> 2
    assert recs == [[4, 2]]
    assert drafter.calls == [(5, 4), (9, 3)]


def test_variable_acceptance_per_step():
    # k depends on the step: 1 at start 5, 3 at start 7, 0 at start 11, 2 afterwards
    ks = {5: 1, 7: 3, 11: 0}
    recs, _ = run([seq_of(20)], [5], k=lambda s: ks.get(s, 2), B=4)
    # 5 ->(2) 7 ->(4) 11 ->(1) 12 ->(3) 15 ->(3) 18 ->(1: last token) 19
    assert recs == [[2, 4, 1, 3, 3, 1]]


def test_batch_equals_one_by_one():
    seqs = [seq_of(30, 0), seq_of(17, 1), seq_of(23, 2)]
    plens = [5, 3, 8]
    ks = lambda s: s % 3  # noqa: E731
    batched, _ = run(seqs, plens, ks, B=4)
    single = [run([s], [p], ks, B=4)[0][0] for s, p in zip(seqs, plens)]
    assert batched == single
    for rec, s, p in zip(batched, seqs, plens):
        assert sum(rec) == len(s) - 1 - p  # every completion token after the prefill one is committed once
