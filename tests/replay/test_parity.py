"""The project's drafter against the reference implementation (``dflash`` on PyPI, z-lab's DFlashDraftModel).

Random tiny drafters (hidden 64), full-attention and sliding-window (2 sliding + 1 full, window
8, block 8) layouts, contexts crossing the window. Checked: the plain forward, the reference's
KV-cached incremental path (``DynamicCache`` + crop, as ``dflash_generate`` drives it), the whole
offline replay against ``dflash_generate`` with a scripted target, and that a stripped folder
loads strictly in the reference.

"max relative difference" = ``max|ours - ref| / max|ref|`` over the compared tensor.
"""

from __future__ import annotations

import copy
import json
import time
import types

import pytest
import torch
from torch import nn

from dflash_eval.cache.format import CacheSample
from dflash_eval.stages.strip_drafter import strip_checkpoint
from dflash_eval.drafter.model import DFlashDrafter, load_drafter
from dflash_eval.drafter.config import DrafterConfig
from dflash_eval.replay.anchors import replay_batched
from dflash_eval.replay.chain import explain_differences, replay_batch
from fixtures.drafters import HIDDEN, LAYER_IDS, TARGET_LAYERS, VOCAB, randomize_, tiny_config

# The reference implementation (dflash==0.1.0, installed by `make venv` from envs/requirements-nodeps.txt).
# Imported plainly: a missing reference must fail the suite, never skip the parity tests silently.
import dflash.model as dflash_model  # noqa: E402
from transformers import Qwen3Config  # noqa: E402

B = 8  # block size
WINDOW = 8
K = len(LAYER_IDS)
CONFIGS = {"full": tiny_config(sliding=False, layers=3, window=WINDOW, block_size=B),
           "sliding": tiny_config(sliding=True, layers=3, window=WINDOW, block_size=B),
           # reference semantics of a top-level is_causal: every layer, windowed ones then look both ways
           "sliding-noncausal": dict(tiny_config(sliding=True, layers=3, window=WINDOW // 2, block_size=B), is_causal=False),
           "full-causal": dict(tiny_config(sliding=False, layers=3, block_size=B), is_causal=True),
           # no layer_types: transformers' Qwen3Config derives them (layers >= max_window_layers slide; the
           # evaluated with full attention while the reference windows them)
           "sliding-implied": dict(tiny_config(sliding=False, layers=3, block_size=B), use_sliding_window=True,
                                   sliding_window=WINDOW, max_window_layers=1)}


def rel_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def make_pair(kind: str, dtype: torch.dtype, seed: int = 0):
    """(reference DFlashDraftModel, our DFlashDrafter) with the same random weights, in ``dtype``."""
    cfg = CONFIGS[kind]
    ref = randomize_(dflash_model.DFlashDraftModel(Qwen3Config(**copy.deepcopy(cfg))), seed)
    ours = DFlashDrafter(DrafterConfig.from_dict(cfg))
    ours.load_state_dict(ref.state_dict(), strict=True)
    if kind == "sliding":  # the reference really runs windowed, causal sliding layers
        attn = ref.layers[0].self_attn
        assert (attn.sliding_window, attn.is_causal) == (WINDOW, True)
        assert (ref.layers[-1].self_attn.sliding_window, ref.layers[-1].self_attn.is_causal) == (None, False)
    if kind == "sliding-implied":
        assert [layer.self_attn.sliding_window for layer in ref.layers] == [None, WINDOW, WINDOW]
        assert ours.cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    return ref.to(dtype).eval(), ours.to(dtype).eval()


def ours_blocks(ours, ctx, emb, starts, vs=None):
    """Our forward for one block per start (rows), from context K/V precomputed once over all positions.

    ctx ``[1, T, K*H]``, emb ``[n, B, H]``; returns ``[n, B, H]``.
    """
    n, t = len(starts), ctx.shape[1]
    pos = torch.arange(t)[None].expand(n, -1)
    st = torch.tensor(starts)[:, None]
    kv = ours.context_kv(ctx.expand(n, -1, -1), pos)
    block_valid = None if vs is None else torch.arange(B)[None] < torch.tensor(vs)[:, None]
    return ours(emb, st + torch.arange(B)[None], kv, pos, pos < st, block_valid)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@torch.no_grad()
def test_forward_matches_reference_fp32(kind):
    ref, ours = make_pair(kind, torch.float32)
    gen = torch.Generator().manual_seed(1)
    ctx = torch.randn(1, 48, K * HIDDEN, generator=gen)
    starts = [1, 5, WINDOW, WINDOW + 3, 3 * WINDOW + 1, 40]  # contexts shorter and much longer than the window
    emb = torch.randn(len(starts), B, HIDDEN, generator=gen)
    got = ours_blocks(ours, ctx, emb, starts)
    for i, s in enumerate(starts):
        want = ref(position_ids=torch.arange(s + B)[None], noise_embedding=emb[i:i + 1], target_hidden=ctx[:, :s])
        assert rel_diff(got[i:i + 1], want) <= 1e-5, (kind, s)


def reference_incremental(ref, ctx, emb, schedule, prompt_len):
    """Drive the reference like ``dflash_generate``: one DynamicCache, new context each step, crop to start.

    Returns the per-step draft states ``[1, B, H]`` and the starts.
    """
    cache = dflash_model._make_cache(ref.config)
    start, new_ctx = prompt_len, ctx[:, :prompt_len]
    outs, starts = [], []
    for step, produced in enumerate(schedule):
        h = ref(target_hidden=new_ctx, noise_embedding=emb[step:step + 1],
                position_ids=torch.arange(start - new_ctx.shape[1], start + B)[None],
                past_key_values=cache, use_cache=True)
        dflash_model._crop_to(cache, start)
        outs.append(h)
        starts.append(start)
        new_ctx = ctx[:, start:start + produced]
        start += produced
    return torch.cat(outs), starts


@pytest.mark.parametrize("kind", ["full", "sliding"])
@torch.no_grad()
def test_bf16_bit_exact_with_reference_forward(kind):
    """One block over exactly the committed context (what the replay computes for a single sample)."""
    ref, ours = make_pair(kind, torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    ctx = torch.randn(1, 48, K * HIDDEN, generator=gen).to(torch.bfloat16)
    for s in (1, WINDOW - 1, WINDOW + 2, 29, 47):
        emb = torch.randn(1, B, HIDDEN, generator=gen).to(torch.bfloat16)
        want = ref(position_ids=torch.arange(s + B)[None], noise_embedding=emb, target_hidden=ctx[:, :s])
        assert torch.equal(ours_blocks(ours, ctx[:, :s], emb, [s]), want), (kind, s)


@pytest.mark.parametrize("kind", ["full", "sliding"])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
@torch.no_grad()
def test_kv_cached_incremental_path_matches(kind, dtype):
    """Our precomputed context K/V against the reference's DynamicCache path (new context per step, crop).

    fp32: max relative difference <= 1e-5 (all steps batched, padded context keys masked).
    bf16: greedy drafts (random LM head) identical step by step. For sliding layers the reference's
    cache keeps only the last ``window - 1`` keys, which moves its bf16 attention by ~1 ulp
    against its own uncached forward; our drafts are compared with both and must equal the
    uncached forward everywhere and the cached one wherever the reference agrees with itself.
    """
    ref, ours = make_pair(kind, dtype)
    gen = torch.Generator().manual_seed(2)
    schedule = [1, 8, 3, 8, 8, 2, 5, 8, 1, 7, 6, 8, 4, 8]  # tokens committed per step
    prompt_len = 4
    ctx = torch.randn(1, prompt_len + sum(schedule), K * HIDDEN, generator=gen).to(dtype)
    emb = torch.randn(len(schedule), B, HIDDEN, generator=gen).to(dtype)
    cached, starts = reference_incremental(ref, ctx, emb, schedule, prompt_len)
    assert starts[-1] > 5 * WINDOW  # the context crosses the window many times
    if dtype == torch.float32:
        assert rel_diff(ours_blocks(ours, ctx, emb, starts), cached) <= 1e-5
        return
    head = torch.randn(VOCAB, HIDDEN, generator=gen).to(dtype)
    ours_h = torch.cat([ours_blocks(ours, ctx[:, :s], emb[i:i + 1], [s]) for i, s in enumerate(starts)])
    plain = torch.cat([ref(position_ids=torch.arange(s + B)[None], noise_embedding=emb[i:i + 1],
                           target_hidden=ctx[:, :s]) for i, s in enumerate(starts)])
    drafts = ours.logits(ours_h[:, 1:], head).argmax(-1)
    drafts_plain = ref.compute_logits(plain[:, 1:], lambda h: h @ head.T).argmax(-1)
    drafts_cached = ref.compute_logits(cached[:, 1:], lambda h: h @ head.T).argmax(-1)
    assert torch.equal(drafts, drafts_plain)
    agree = drafts_plain == drafts_cached
    assert torch.equal(drafts[agree], drafts_cached[agree])
    if kind == "full":
        assert bool(agree.all())  # the full-attention cache keeps every key: identical to the uncached path
    else:
        assert float(agree.float().mean()) >= 0.95


class ScriptedTarget(nn.Module):
    """A stand-in target for ``dflash_generate``.

    Hidden states depend only on the position (``table[l, p]``, so teacher-forced replay sees exactly
    what online decoding saw); greedy verification accepts the first ``accept(start)`` drafts and
    then predicts a token that differs from the next draft.
    """

    def __init__(self, table: torch.Tensor, embed: torch.Tensor, head: torch.Tensor, accept):
        super().__init__()
        self.table, self.accept = table, accept
        self.config = Qwen3Config(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4, vocab_size=VOCAB)
        self.embed_tokens = nn.Embedding.from_pretrained(embed)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight.data = head
        self.device = torch.device("cpu")

    def get_input_embeddings(self):
        return self.embed_tokens

    def forward(self, input_ids, position_ids, past_key_values=None, use_cache=False, logits_to_keep=0,
                output_hidden_states=False):
        pos = position_ids[0]
        hidden = tuple(self.table[layer, pos][None] for layer in range(self.table.shape[0]))
        logits = torch.zeros(1, len(pos), VOCAB)
        if logits_to_keep == 1:  # prefill: the first generated token
            logits = torch.zeros(1, 1, VOCAB)
            logits[0, 0, 11] = 1.0
        else:
            block = input_ids[0]
            k = min(self.accept(int(pos[0])), len(block) - 1)
            for j in range(k):
                logits[0, j, block[j + 1]] = 1.0
            nxt = int(block[k + 1]) + 1 if k + 1 < len(block) else 5
            logits[0, k, nxt % VOCAB] = 1.0
        return types.SimpleNamespace(logits=logits, hidden_states=hidden)


@pytest.mark.parametrize("kind,dtype,cache", [
    ("full", torch.float32, "reference"), ("sliding", torch.float32, "reference"),
    pytest.param("full", torch.bfloat16, "reference", marks=pytest.mark.slow),
    pytest.param("sliding", torch.bfloat16, "full-length", marks=pytest.mark.slow),
])
@torch.no_grad()
def test_replay_matches_reference_dflash_generate(kind, dtype, cache, monkeypatch):
    """Offline replay of the committed sequence gives ``dflash_generate``'s acceptance lengths, step for step.

    Two prompts, one longer than the window; the responses cross it many times. ``full-length``:
    the reference loop with a cache that keeps every key (its windowed mask still applies), since
    its sliding-window cache shifts bf16 results by ~1 ulp (see the incremental-path test).
    """
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)  # CPU run
    if cache == "full-length":
        monkeypatch.setattr(dflash_model, "_make_cache", lambda config: dflash_model.DynamicCache())
    ref, ours = make_pair(kind, dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    max_new = 70
    table = torch.randn(TARGET_LAYERS + 1, 11 + max_new + 1, HIDDEN, generator=gen).to(dtype)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen).to(dtype)
    head = torch.randn(VOCAB, HIDDEN, generator=gen).to(dtype)
    target = ScriptedTarget(table, embed, head, accept=lambda start: (start * 7 + start // 3) % B)
    samples, want = [], []
    for i, prompt_len in enumerate((11, 4)):
        prompt = torch.randint(0, VOCAB - 1, (1, prompt_len), generator=gen)
        res = dflash_model.dflash_generate(ref, target, prompt, max_new, stop_token_ids=None, return_stats=True)
        ids = res.output_ids[0]
        hidden = table[[j + 1 for j in LAYER_IDS], : len(ids)].transpose(0, 1)  # [T, K, H]
        samples.append(CacheSample(i, f"s{i}", ids, prompt_len, hidden, ids.clone(), "length", max_new))
        want.append(res.acceptance_lengths)
        assert len(set(want[-1])) >= 4 and sum(want[-1]) == len(ids) - prompt_len - 1  # varied, whole response
    if dtype == torch.float32:  # side by side (padded context keys are masked)
        got = replay_batch(ours, embed, head, samples)
    else:  # one at a time: the attention then sees exactly the reference's keys, bit for bit
        got = [replay_batch(ours, embed, head, [s])[0] for s in samples]
    assert got == want
    # all-anchor replay, every layout: one drafter call over both samples, and ~10 anchors per call
    for layout, memory_bytes in (("rows", 10**9), ("rows", 2_000_000), ("packed", 10**9), ("packed", 2_000_000),
                                 ("groups", 10**9), ("groups", 2_000_000)):
        stats = {}
        batched = replay_batched(ours, embed, head, samples, memory_bytes=memory_bytes, layout=layout, stats=stats)
        assert (stats["calls"] <= 2) == (memory_bytes == 10**9)
        if dtype == torch.float32:
            assert batched == want
        else:  # bf16: packing changes reduction order; a flip is allowed only at a near-tie (<= 4 ulps)
            ties = explain_differences(ours, embed, head, samples, batched, want)
            assert all(t["gap_ulps"] <= 4 for t in ties), ties


@pytest.mark.parametrize("kind", ["full", "sliding"])
@torch.no_grad()
def test_stripped_output_loads_strictly_in_reference(kind, tmp_path):
    ref, _ = make_pair(kind, torch.float32, seed=5)
    src = ref.to(torch.bfloat16).state_dict()
    torch.save({"model": {f"module.{k}": v for k, v in src.items()}, "draft_config": CONFIGS[kind]}, tmp_path / "c.pt")
    out = strip_checkpoint(tmp_path / "c.pt", tmp_path / "out")
    loaded, info = dflash_model.DFlashDraftModel.from_pretrained(out, output_loading_info=True)
    assert {k: list(v) for k, v in info.items() if v} == {}  # no missing / unexpected / mismatched keys, no errors
    for k, v in src.items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert loaded.target_layer_ids == LAYER_IDS and loaded.block_size == B
    assert [layer.self_attn.sliding_window for layer in loaded.layers] == \
           [layer.self_attn.sliding_window for layer in ref.layers]
    ours = load_drafter(out, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(6)
    ctx = torch.randn(1, 30, K * HIDDEN, generator=gen).to(torch.bfloat16)
    emb = torch.randn(1, B, HIDDEN, generator=gen).to(torch.bfloat16)
    want = loaded.to(torch.bfloat16)(position_ids=torch.arange(30 + B)[None], noise_embedding=emb, target_hidden=ctx)
    got = ours_blocks(ours, ctx, emb, [30])
    assert rel_diff(got, want) <= 2e-2  # bf16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
