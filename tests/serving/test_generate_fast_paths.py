"""CPU fast paths of greedy generation (TransformersSource): same tokens as the plain left-padded generate()."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def test_sdpa_gqa_equals_repeated_kv_heads():
    import torch.nn.functional as F

    from dflash_eval.target.model import sdpa_gqa_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 6, 1, 8, generator=g)
    k, v = torch.randn(3, 2, 20, 8, generator=g), torch.randn(3, 2, 20, 8, generator=g)
    mask = torch.ones(3, 1, 1, 20, dtype=torch.bool)
    mask[0, ..., :7] = False  # left padding
    module = type("Attn", (), {"num_key_value_groups": 3, "is_causal": True})()
    out, _ = sdpa_gqa_attention(module, q, k, v, mask, scaling=8 ** -0.5)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask,
                                         scale=8 ** -0.5).transpose(1, 2)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fast_generate_matches_plain_generate(tmp_path, arch, monkeypatch):
    """Unpadded prefill + GQA-in-place attention give the completions of the plain padded generate()."""
    from tiny import make_tiny_target

    import dflash_eval.target.model as T
    from dflash_eval.serving.generation import TransformersSource

    target = make_tiny_target(tmp_path / "t", arch=arch, num_layers=3, hidden=64, seed=3)
    model, tok, _ = T.load_target(target, device="cpu", dtype="float32")
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, len(tok), (n,), generator=g).tolist() for n in (17, 3, 1, 30, 9)]
    src = TransformersSource(model, tok, max_new_tokens=12)
    calls = []
    real = T.prefill_unpadded
    monkeypatch.setattr(T, "prefill_unpadded", lambda *a: calls.append(1) or real(*a))
    fast = src.generate(prompts)
    assert calls and real(model, prompts, 30) is not None  # the fast prefill was used
    monkeypatch.setattr(T, "prefill_unpadded", lambda *a: None)
    monkeypatch.setattr(T, "gqa_sdpa", lambda m: contextlib.nullcontext())
    plain = src.generate(prompts)
    assert fast == plain
    assert model.config._attn_implementation == "sdpa"


def test_preallocated_kv_layer_writes_in_place(tmp_path):
    """prefill_unpadded(capacity=...) sizes each layer's buffers once; decoding writes into them (no
    concatenation) and the cache holds exactly what the concatenating DynamicLayer would; past the
    capacity it falls back to concatenation."""
    from tiny import make_tiny_target

    import dflash_eval.target.model as T

    target = make_tiny_target(tmp_path / "t", arch="llama", num_layers=2, hidden=64, seed=3)
    model, tok, _ = T.load_target(target, device="cpu", dtype="float32")
    prompts = [[5, 6, 7, 8], [9, 10]]
    plain = T.prefill_unpadded(model, prompts, 4)
    cache = T.prefill_unpadded(model, prompts, 4, capacity=5)
    layer, ref = cache.layers[0], plain.layers[0]
    kbuf, vbuf = layer._bufs
    assert kbuf.shape[-2] == 5 and layer.keys.shape[-2] == 3
    assert torch.equal(layer.keys, ref.keys) and torch.equal(layer.values, ref.values)
    g = torch.Generator().manual_seed(0)
    for step in range(3):  # 3 -> 4 -> 5 positions in the buffer, then 6: concatenated
        k, v = torch.randn(2, *ref.keys.shape[1:2], 1, ref.keys.shape[-1], generator=g), None
        v = torch.randn(k.shape, generator=g)
        keys, values = layer.update(k, v)
        ref_keys, ref_values = ref.update(k, v)
        assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)
        in_buffer = step < 2
        assert (keys.data_ptr() == kbuf.data_ptr()) == in_buffer
        assert (values.data_ptr() == vbuf.data_ptr()) == in_buffer
    assert layer.get_seq_length() == 6


def test_decode_steps_logged_without_changing_tokens(tmp_path, caplog):
    """A batch logs its decode steps (throttled; here every step) and yields the same tokens."""
    import logging

    from tiny import make_tiny_target

    import dflash_eval.target.model as T
    from dflash_eval.serving.generation import TransformersSource

    target = make_tiny_target(tmp_path / "t", arch="llama", num_layers=2, hidden=64, seed=3)
    model, tok, _ = T.load_target(target, device="cpu", dtype="float32")
    prompts = [[5, 6, 7, 8], [9, 10]]
    src = TransformersSource(model, tok, max_new_tokens=6, stop_ids=[10 ** 6])  # no stop: 6 steps
    quiet = src.generate(prompts)
    src.log_every = 0.0
    with caplog.at_level(logging.INFO, logger="dflash_eval.serving.generation"):
        loud = src.generate(prompts)
    assert loud == quiet and all(len(ids) == 6 for ids, _ in loud)
    steps = [r.getMessage() for r in caplog.records if "decode step" in r.getMessage()]
    assert [m.split("decode step ")[1].split(",")[0] for m in steps] == [f"{i}/6" for i in range(1, 7)]
    assert steps[0].startswith("batch of 2 prompts")


def test_memory_sized_decode_batch_by_hand():
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash_eval.target.model import CPU_DECODE_BATCH, MAX_DECODE_BATCH, decode_batch_size

    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()  # float32: 4 bytes per element
    weights = sum(p.numel() for p in model.parameters()) * 4
    P, N = 100, 60
    # per row: KV 2*3*2*16*4 = 768 B x 160 positions; prefill 4*(6*64 + 3*128) = 3072 B x 100; mask 100*100*4; logits 16k
    per_row = 768 * 160 + 3072 * 100 + 100 * 100 * 4 + 16 * 1000
    assert per_row == 486_080
    total = int((weights + 37 * per_row) / 0.6) + 10  # room for 37 rows -> 32 (power of two)
    assert decode_batch_size(model, P, N, total_memory=total) == 32
    assert decode_batch_size(model, P, N, total_memory=int((weights + 31 * per_row) / 0.6) + 10) == 16
    assert decode_batch_size(model, P, N, total_memory=10**15) == MAX_DECODE_BATCH
    assert decode_batch_size(model, P, N, total_memory=1) == 1  # never 0
    assert decode_batch_size(model, P, N) == CPU_DECODE_BATCH  # CPU: not sized


def test_decode_cache_of_a_hybrid_counts_its_linear_layers_as_fixed_states():
    """A Qwen3-Next / Qwen3.5 hybrid's memory-sized batch: only its full-attention layers grow with the positions;
    each Gated DeltaNet layer holds a float32 recurrent state and a convolution state, by hand."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, Qwen3NextConfig

    from dflash_eval.target.model import cache_bytes_per_row

    llama = LlamaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    assert cache_bytes_per_row(llama, 160, 4) == 768 * 160  # 2 x 3 layers x 2 KV heads x 16 x 4 B per position
    hybrid = Qwen3NextConfig(num_hidden_layers=8, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=64, linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=32,
                             linear_value_head_dim=32, linear_conv_kernel_dim=4)
    assert hybrid.layer_types.count("full_attention") == 2 and hybrid.layer_types.count("linear_attention") == 6
    kv = 2 * 2 * 64 * 2  # bf16: 512 B per position per full-attention layer
    state = 4 * 8 * 32 * 32 + 2 * (2 * 4 * 32 + 8 * 32) * 4  # float32 recurrent + bf16 conv: 32,768 + 4,096
    assert cache_bytes_per_row(hybrid, 1000, 2) == 2 * kv * 1000 + 6 * state == 1_245_184
    # 3.3x less than counting all 8 layers as full attention (8 x 512 x 1000 = 4,096,000) at 1,000 positions
    sliding = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64,
                              num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=64)
    assert cache_bytes_per_row(sliding, 1000, 4) == 256 * 64 + 256 * 1000
