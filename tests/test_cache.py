"""HDF5 cache: bit-exact bf16 round trip, attributes, hook capture == HF hidden_states[i+1]."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from dflash_eval.cache import FILE_ATTRS, CacheReader, from_storage, to_storage, write_cache
from dflash_eval.extract import run_target
from dflash_eval.runtime import length_batches
from dflash_eval.errors import InputError


def test_bf16_round_trip_is_bit_exact(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 3, 16, generator=g) * 100).to(torch.bfloat16)
    x[0, 0, :4] = torch.tensor([float("inf"), -0.0, 1e-40, float("nan")]).to(torch.bfloat16)
    arr, logical = to_storage(x)
    assert arr.dtype == np.uint16 and logical == "bfloat16"
    attrs = {"format": "dflash-eval/hidden-state-cache", "format_version": 1, "target_layer_ids": [1, 2, 5],
             "hidden_size": 16, "num_target_layers": 6}
    sample = {"sample_id": "HumanEval/0", "input_ids": list(range(37)), "prompt_len": 10, "hidden": x,
              "target_argmax": np.arange(37), "stop_reason": "eos", "max_new_tokens": 64, "argmax_agreement": 1.0}
    write_cache(tmp_path / "c.h5", attrs, [sample])
    with CacheReader(tmp_path / "c.h5") as rd:
        s = rd.sample(0)
        assert s.hidden.dtype == torch.bfloat16
        assert torch.equal(s.hidden.view(torch.int16), x.view(torch.int16))  # bit-exact, NaN payload included
        assert s.sample_id == "HumanEval/0" and s.prompt_len == 10 and s.max_new_tokens == 64
        sub = rd.sample(0, [5, 1])  # layer selection keeps the requested order
        assert torch.equal(sub.hidden.view(torch.int16), x[:, [2, 0]].view(torch.int16))
        with pytest.raises(InputError, match=r"needs target layers \[3\]"):
            rd.sample(0, [1, 3])
    assert torch.equal(from_storage(*to_storage(x.float())).view(torch.int32), x.float().view(torch.int32))
    assert not list(tmp_path.glob(".*tmp"))  # no temp file left behind


def test_failed_write_leaves_nothing(tmp_path):
    def boom():
        yield {"sample_id": "a", "input_ids": [1, 2], "prompt_len": 1, "hidden": torch.zeros(2, 1, 4),
               "target_argmax": [0, 0], "stop_reason": "eos", "max_new_tokens": 4, "argmax_agreement": 1.0}
        raise RuntimeError("GPU fell off")

    with pytest.raises(RuntimeError):
        write_cache(tmp_path / "c.h5", {"format": "dflash-eval/hidden-state-cache", "format_version": 1,
                                         "target_layer_ids": [0]}, boom())
    assert list(tmp_path.iterdir()) == []


def test_reader_rejects_foreign_files(tmp_path):
    with h5py.File(tmp_path / "x.h5", "w") as f:
        f.attrs["format"] = "something-else"
    with pytest.raises(InputError, match="expected 'dflash-eval/hidden-state-cache'"):
        CacheReader(tmp_path / "x.h5")
    with pytest.raises(InputError, match="not found"):
        CacheReader(tmp_path / "missing.h5")


def test_length_batches():
    assert length_batches([5, 10, 3, 10], max_tokens=20) == [[1, 3], [0, 2]]
    assert length_batches([50, 1], max_tokens=20) == [[0], [1]]  # over-long samples get a batch of their own
    # by count (the completions stage): longest first, stable among equal lengths
    assert length_batches([3, 9, 1, 9, 5], max_items=2) == [[1, 3], [4, 0], [2]]
    assert sorted(i for b in length_batches(list(range(7)), max_items=3) for i in b) == list(range(7))
    # both limits: at most 2 items and at most 20 padded tokens
    assert length_batches([4, 4, 4, 12, 12], max_tokens=20, max_items=2) == [[3], [4], [0, 1], [2]]


def test_hooks_match_hf_hidden_states_and_padding_is_harmless():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval()
    seqs = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5]]
    layer_ids = [0, 2, 3]  # 3 = last layer: HF's last entry is final-normed
    outs = run_target(model, seqs, layer_ids, "cpu")
    for seq, (hidden, argmax) in zip(seqs, outs):
        with torch.no_grad():
            ref = model(torch.tensor([seq]), output_hidden_states=True)
        for k, i in enumerate(layer_ids):
            torch.testing.assert_close(hidden[:, k], ref.hidden_states[i + 1][0], rtol=1e-5, atol=1e-5)
        assert torch.equal(argmax, ref.logits[0].argmax(-1))


def test_file_attrs_documented():
    assert {"target_sha256", "target_layer_ids", "dtype", "device", "torch_version", "transformers_version",
            "fla_version", "linear_attn_kernel"} <= set(FILE_ATTRS)
