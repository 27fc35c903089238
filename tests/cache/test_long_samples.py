"""Long samples in the hidden_states stage: device memory per forward, and a sample that does not fit the device.

The forward keeps O(one batch) on the device: hooks on the stored layers (never every layer's states) and the LM
head's logits in chunks of at most ``LOGITS_CHUNK_BYTES`` (a 32k-token sample's full-vocabulary logits never exist at
once). A batch that cannot fit (the pre-check against the free memory, or an out-of-memory in the forward) stops the
stage with an InputError naming the sample and its length, after the batches before it are committed; the rerun
resumes them. CUDA is simulated on the CPU: the free-memory function and the forward are patched.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dflash_eval.cache.extract as extract_mod
import dflash_eval.stages.hidden_states as hs
from dflash_eval.cache.reader import CacheReader
from dflash_eval.core.errors import InputError
from tiny import make_tiny_target

LAYERS = [1, 3]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("long") / "target", num_layers=4, hidden=64)


def completions(path, lengths: list[int]):
    rng = np.random.default_rng(0)
    rows = [{"id": f"s{i}", "prompt_ids": rng.integers(4, 300, size=T - 4).tolist(),
             "completion_ids": rng.integers(4, 300, size=4).tolist(), "stop_reason": "length", "max_new_tokens": 4}
            for i, T in enumerate(lengths)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class LargestTensor(TorchDispatchMode):
    """Records the bytes of the largest tensor any op returns (weights are inputs, not counted)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def largest_in_forward(monkeypatch, target, tmp_path, lengths: list[int], batch_tokens: int) -> int:
    mode = LargestTensor()
    real = hs.forward_batch

    def measured(*a, **kw):
        with mode:
            return real(*a, **kw)

    monkeypatch.setattr(hs, "forward_batch", measured)
    comp = completions(tmp_path / f"c{len(lengths)}_{max(lengths)}.jsonl", lengths)
    hs.extract_hidden_states(target, comp, tmp_path / f"{comp.stem}.h5", LAYERS, device="cpu", dtype="float32",
                             batch_tokens=batch_tokens)
    return mode.largest


def test_forward_memory_linear_in_length_not_in_samples(monkeypatch, target, tmp_path):
    """The largest tensor of the stage's forward: 4x the tokens -> <= 4x the bytes (linear, no T^2 and no T x vocab
    beyond one logits chunk); 4 samples of 256 tokens -> the same as one (O(one sample), not O(samples)). The logits
    chunk is set to 16 rows of the 384-token vocabulary (16 x 384 x 4 bytes), so a full [T, V] logits tensor (256 x
    384 x 4 = 393,216 bytes) would be the largest; the kept states [T, 2, 64] x 4 bytes = 131,072 bytes at T = 256."""
    monkeypatch.setattr(extract_mod, "LOGITS_CHUNK_BYTES", 16 * 384 * 4)
    short = largest_in_forward(monkeypatch, target, tmp_path, [64], 256)
    long = largest_in_forward(monkeypatch, target, tmp_path, [256], 256)
    many = largest_in_forward(monkeypatch, target, tmp_path, [256] * 4, 256)
    assert long == many
    assert long <= 4 * short
    assert long < 256 * 384 * 4  # never the full logits of the sample
    assert long >= 256 * len(LAYERS) * 64 * 4  # the kept states [256, 2, 64] float32 are there


def test_forward_bytes_hand_computed():
    """forward_bytes on the 8.16B hybrid's shape (hidden 4096, FFN 12288, vocab 151936), one 32,768-token sample,
    5 layers kept, bf16: states 32768 x 5 x 4096 x 2 = 1,342,177,280; activations 32768 x (3 x 12288 + 6 x 4096) x 2 =
    4,026,531,840; logits capped at one chunk 1,073,741,824: 6,442,450,944 bytes (6.0 GiB)."""
    cfg = type("C", (), {"hidden_size": 4096, "intermediate_size": 12288, "vocab_size": 151936})
    assert extract_mod.forward_bytes(cfg, [32768], 5, 2, packed=False) == 6_442_450_944
    # padded: 2 samples of 1000 and 10 tokens -> activations over 2 x 1000 rows, states over 1010 tokens
    assert extract_mod.forward_bytes(cfg, [1000, 10], 5, 2, packed=False) == (
        2 * (1010 * 5 * 4096 + 2000 * (3 * 12288 + 6 * 4096)) + 1010 * 151936 * 2)


def run_until_error(target, comp, out, **kw) -> InputError:
    with pytest.raises(InputError) as err:
        hs.extract_hidden_states(target, comp, out, LAYERS, device="cpu", dtype="float32", batch_tokens=64, **kw)
    return err.value


def finish_and_compare(target, comp, out, tmp_path, caplog, kept: int) -> None:
    """The rerun keeps the committed samples and its cache equals an uninterrupted run's."""
    with caplog.at_level(logging.INFO, logger="dflash_eval.stages.hidden_states"):
        hs.extract_hidden_states(target, comp, out, LAYERS, device="cpu", dtype="float32", batch_tokens=64)
    assert f"{kept} verified in the partial file and kept" in caplog.text
    ref = hs.extract_hidden_states(target, comp, tmp_path / "ref.h5", LAYERS, device="cpu", dtype="float32",
                                   batch_tokens=64)
    with CacheReader(out) as a, CacheReader(ref) as b:
        assert a.sample_ids == b.sample_ids == ["s0", "s1", "s2", "s3"]
        for i in range(4):
            assert torch.equal(a.sample(i).hidden, b.sample(i).hidden)


def test_precheck_refuses_batch_after_committing_earlier(monkeypatch, target, tmp_path, caplog):
    """Lengths 50, 20, 20, 20 at batch_tokens 64: batches [s0] (50 tokens) and [s1, s2, s3] (60). The free memory
    patched between the two batches' estimates: the first batch is written, the second refused before its forward,
    naming its longest sample (s1, 20 tokens, the first of equal lengths), the batch and the 1 committed sample."""
    comp = completions(tmp_path / "c.jsonl", [50, 20, 20, 20])
    cfg = type("C", (), {"hidden_size": 64, "intermediate_size": 128, "vocab_size": 384})
    first, second = (extract_mod.forward_bytes(cfg, lens, 2, 4, packed=True) for lens in ([50], [20, 20, 20]))
    assert first < second
    monkeypatch.setattr(hs, "device_free_bytes", lambda dev: (first + second) // 2)
    calls = []
    real = hs.forward_batch
    monkeypatch.setattr(hs, "forward_batch", lambda model, seqs, *a, **kw: calls.append(len(seqs)) or real(model, seqs, *a, **kw))
    out = tmp_path / "c.h5"
    err = run_until_error(target, comp, out)
    assert calls == [1]  # the refused batch never ran
    text = str(err)
    assert "id s1" in text and "'s1' of 20 tokens (in a batch of 3 samples, 60 tokens)" in text
    assert "(estimated)" in text and "1 of 4 samples are committed" in text and "c.h5.partial" in text
    assert "target.devices" in text and "max_prompt_tokens" in text
    monkeypatch.setattr(hs, "device_free_bytes", lambda dev: None)
    monkeypatch.setattr(hs, "forward_batch", real)
    finish_and_compare(target, comp, out, tmp_path, caplog, kept=1)


def test_out_of_memory_in_forward_names_sample(monkeypatch, target, tmp_path, caplog):
    """An out-of-memory in the second batch's forward (patched to raise torch.cuda.OutOfMemoryError): the InputError
    names its sample and length, the first batch's sample stays committed, the rerun resumes it."""
    comp = completions(tmp_path / "c.jsonl", [50, 20, 20, 20])
    real = hs.forward_batch

    def oom_on_second(model, seqs, *a, **kw):
        if len(seqs) == 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return real(model, seqs, *a, **kw)

    monkeypatch.setattr(hs, "forward_batch", oom_on_second)
    out = tmp_path / "c.h5"
    err = run_until_error(target, comp, out)
    text = str(err)
    assert "'s1' of 20 tokens (in a batch of 3 samples, 60 tokens) ran out of memory on cpu" in text
    assert "1 of 4 samples are committed" in text
    assert isinstance(err.__cause__, torch.cuda.OutOfMemoryError)
    monkeypatch.setattr(hs, "forward_batch", real)
    finish_and_compare(target, comp, out, tmp_path, caplog, kept=1)


def test_evaluate_out_of_memory_names_sample(monkeypatch, target, tmp_path):
    """evaluate: an out-of-memory in a replay group (the replay patched to raise it) becomes an InputError naming the
    group's longest sample (s0, 50 tokens) and the fix (evaluate.batch_size: 1); without the patch the same call
    replays every sample."""
    import dflash_eval.stages.evaluate as ev
    from tiny import make_random_drafter

    comp = completions(tmp_path / "c.jsonl", [50, 20, 20, 20])
    cache = hs.extract_hidden_states(target, comp, tmp_path / "c.h5", LAYERS, device="cpu", dtype="float32")
    make_random_drafter(tmp_path / "drafter", target, LAYERS, block_size=4)
    kw = dict(device="cpu", dtype="float32", allow_low_agreement=True, ddtree_budgets=[])
    real = ev.replay

    def oom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(ev, "replay", oom)
    with pytest.raises(InputError) as err:
        ev.evaluate(tmp_path / "drafter", cache, target, tmp_path / "e.json", **kw)
    text = str(err.value)
    assert "id s0" in text and "'s0' of 50 tokens (in a group of 4 samples) ran out of memory on cpu" in text
    assert "evaluate.batch_size: 1" in text and not (tmp_path / "e.json").exists()
    monkeypatch.setattr(ev, "replay", real)
    assert ev.evaluate(tmp_path / "drafter", cache, target, tmp_path / "e.json", **kw)["n_samples"] == 4


def test_evaluate_replay_memory_linear_in_length(monkeypatch, target, tmp_path):
    """evaluate's replay, one sample at a time (evaluate.batch_size 1): the largest tensor of the replay for one
    256-token sample is at most 4x that of one 64-token sample (each with a 16-token completion: the context grows,
    the drafted tokens do not) and the same for 4 such samples as for one (O(one sample), not O(samples)); the
    default (batch_size 0) groups samples by the free memory instead."""
    import dflash_eval.stages.evaluate as ev
    from tiny import make_random_drafter

    make_random_drafter(tmp_path / "drafter", target, LAYERS, block_size=4)
    real = ev.replay

    def largest(lengths: list[int]) -> int:
        rng = np.random.default_rng(1)
        comp = tmp_path / f"e{len(lengths)}_{max(lengths)}.jsonl"
        comp.write_text("".join(json.dumps({"id": f"s{i}", "prompt_ids": rng.integers(4, 300, size=T - 16).tolist(),
                                            "completion_ids": rng.integers(4, 300, size=16).tolist(),
                                            "stop_reason": "length", "max_new_tokens": 16}) + "\n"
                                for i, T in enumerate(lengths)))
        cache = hs.extract_hidden_states(target, comp, tmp_path / f"{comp.stem}.h5", LAYERS, device="cpu",
                                         dtype="float32")
        mode = LargestTensor()

        def measured(*a, **k):
            with mode:
                return real(*a, **k)

        monkeypatch.setattr(ev, "replay", measured)
        res = ev.evaluate(tmp_path / "drafter", cache, target, tmp_path / f"{comp.stem}.json", device="cpu",
                          dtype="float32", allow_low_agreement=True, ddtree_budgets=[], batch_size=1)
        assert res["n_samples"] == len(lengths)
        return mode.largest

    short, long, many = largest([64]), largest([256]), largest([256] * 4)
    assert long == many
    assert short < long <= 4 * short
