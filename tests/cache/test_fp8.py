"""FP8 cache storage (``cache.storage: fp8``): the quantisation's error bound, the size against bf16, verified
reads (a flipped byte of the FP8 states or of their scales is refused like one of a bf16 sample), layer selection."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from dflash_eval.cache.disk_room import bytes_per_token
from dflash_eval.cache.format import (FP8_MAX, SCALE_DATASET, STORAGE_BF16, STORAGE_F32, STORAGE_FP8,
                                      dequantize_fp8, quantize_fp8)
from dflash_eval.cache.reader import CacheReader
from dflash_eval.cache.writer import write_cache
from dflash_eval.core.errors import InputError
from dflash_eval.stages.fp8_parity import restored_copy

LAYERS = [1, 8, 15, 22, 27]


def _states(T: int, K: int, H: int, seed: int = 0) -> torch.Tensor:
    """Hidden-state-like values: Gaussian rows of different scales per token and layer, with a few outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, H, generator=g) * torch.exp(torch.randn(T, K, 1, generator=g))
    x[:, :, 3] *= 40  # one massive activation channel, as real targets have
    return x


def _write(path, x: torch.Tensor, storage: str, dtype: str = "float32"):
    T, K, H = x.shape
    attrs = {"format": "dflash-eval/hidden-state-cache", "format_version": 6, "target_layer_ids": LAYERS[:K],
             "hidden_size": H, "num_target_layers": 30, "dtype": dtype, "storage": storage}
    sample = {"sample_id": "s0", "input_ids": list(range(T)), "prompt_len": T // 4, "hidden": x,
              "target_argmax": np.arange(T) % 7, "stop_reason": "eos", "max_new_tokens": T}
    write_cache(path, attrs, [sample])
    return path


def test_quantisation_is_within_e4m3_rounding_and_keeps_each_rows_amax():
    x = _states(64, 5, 256)
    q, scale = quantize_fp8(x)
    assert q.dtype == torch.uint8 and q.shape == x.shape and scale.shape == (64, 5) and scale.dtype == torch.float32
    assert torch.allclose(scale, x.abs().amax(-1) / FP8_MAX)
    y = dequantize_fp8(q.numpy(), scale.numpy(), "float32")
    # E4M3: 3 mantissa bits, round to nearest: relative error <= 2^-4 for normals; subnormals (|x / scale| < 2^-6)
    # have a step of 2^-9, so an absolute error <= 2^-10 * scale
    bound = torch.maximum(x.abs() * 2.0 ** -4, scale[..., None] * 2.0 ** -10) * (1 + 1e-6)
    assert ((y - x).abs() <= bound).all()
    rows = x.abs().argmax(-1, keepdim=True)  # 448 is exact in E4M3: the largest value of each row comes back
    assert torch.allclose(y.gather(-1, rows), x.gather(-1, rows), rtol=1e-6)
    rel = ((y - x).norm() / x.norm()).item()
    assert 0.005 < rel < 0.04  # ~2^-4 / sqrt(3) of uniform rounding on a log scale: about 2 %
    zero = torch.zeros(2, 1, 8)
    qz, sz = quantize_fp8(zero)  # an all-zero row: scale 0, no NaN
    assert (sz == 0).all() and (dequantize_fp8(qz.numpy(), sz.numpy(), "float32") == 0).all()
    assert dequantize_fp8(q.numpy(), scale.numpy(), "bfloat16").dtype == torch.bfloat16


def test_fp8_cache_is_half_a_bf16_one_and_reads_back_verified(tmp_path):
    x = _states(1024, 5, 576)  # SmolLM2's hidden size, the demo's five layers
    bf16 = _write(tmp_path / "bf16.h5", x.to(torch.bfloat16), STORAGE_BF16, "bfloat16")
    fp8 = _write(tmp_path / "fp8.h5", x, STORAGE_FP8, "float32")
    ratio = bf16.stat().st_size / fp8.stat().st_size
    assert ratio >= 1.9, ratio
    assert abs(ratio - bytes_per_token("bfloat16", 5, 576) / bytes_per_token("fp8", 5, 576)) < 0.03
    with CacheReader(fp8) as rd:
        assert rd.fp8
        s = rd.sample(0)
        assert s.hidden.dtype == torch.float32 and s.hidden.shape == x.shape
        assert ((s.hidden - x).norm() / x.norm()).item() < 0.04
        sub = rd.sample(0, [15, 1])  # a selection of layers picks the matching scales
        assert torch.equal(sub.hidden, s.hidden[:, [2, 0]])
        with rd.verified_samples([0]) as got:
            assert torch.equal(got[0].hidden, s.hidden)
        assert rd.verify() == []
    with h5py.File(fp8, "r") as f:
        g = f["samples/000000"]
        assert g["hidden"].dtype == np.uint8 and g[SCALE_DATASET].shape == (1024, 5)


@pytest.mark.parametrize("dataset", ["hidden", SCALE_DATASET])
def test_a_flipped_byte_of_fp8_states_or_scales_is_refused(tmp_path, dataset):
    path = _write(tmp_path / "fp8.h5", _states(64, 3, 32), STORAGE_FP8)
    with h5py.File(path, "r+") as f:
        d = f[f"samples/000000/{dataset}"]
        raw = d[()]
        b = raw.view(np.uint8).reshape(-1)
        b[100] ^= 0x04  # one bit of one byte
        d[...] = raw
    with CacheReader(path) as rd:
        with pytest.raises(InputError, match="do not match their checksum"):
            rd.sample(0)
        with pytest.raises(InputError, match="do not match their checksum"):
            with rd.verified_samples([0]):
                pass
        assert rd.verify() == [0]


def test_non_finite_states_give_a_non_finite_scale_that_is_refused(tmp_path):
    x = _states(16, 3, 32)
    x[5, 2, 7] = float("inf")
    path = _write(tmp_path / "fp8.h5", x, STORAGE_FP8)
    with CacheReader(path) as rd, pytest.raises(InputError, match="non-finite hidden state .* token 5, target layer 15"):
        rd.sample(0)


def test_an_unknown_storage_is_refused(tmp_path):
    path = _write(tmp_path / "c.h5", _states(8, 1, 16), "float16 bits")
    with pytest.raises(InputError, match="not a storage this version reads"):
        CacheReader(path)


def test_the_documented_h5py_reader_of_fp8_samples_runs(tmp_path):
    """The FP8 h5py example of docs/cache-format.md (no torch) gives what CacheReader gives."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "cache-format.md").read_text(encoding="utf-8")
    (code,) = [c for c in re.findall(r"```python\n(.*?)```", text, re.S) if "E4M3" in c]
    x = _states(40, 3, 64)
    path = _write(tmp_path / "fp8.h5", x, STORAGE_FP8)
    scope: dict = {}
    exec(compile(code.replace("results/demo/cache/humaneval.fp8.h5", str(path)), "docs/cache-format.md", "exec"), scope)
    with CacheReader(path) as rd:
        np.testing.assert_allclose(scope["hidden"], rd.sample(0).hidden.numpy(), rtol=1e-6, atol=0)


def test_storage_flag_only_when_set_so_existing_runs_keep_their_params():
    """cache.storage is left out of hidden_states' flags (its rule's params) at its default: a run that does not
    set it reruns no extraction after the upgrade that added it; fp8 is passed (and so reruns)."""
    from dflash_eval.core.options import to_flags

    assert not any(w.startswith("--storage") for w in to_flags("hidden_states", {"storage": "dtype"}, rerun=True))
    assert "--storage=fp8" in to_flags("hidden_states", {"storage": "fp8"}, rerun=True)


def test_evaluate_dequantises_fp8_on_a_cuda_device_and_on_the_host_for_the_cpu(tmp_path):
    from dflash_eval.stages.evaluate import open_cache

    path = _write(tmp_path / "fp8.h5", _states(16, 5, 576), STORAGE_FP8, "float32")
    with open_cache(path, torch.device("cuda")) as rd:  # nothing is moved until a sample is read
        assert rd.dequant_device == torch.device("cuda")
    with open_cache(path, torch.device("cpu")) as rd:
        assert rd.dequant_device is None and rd.sample(0).hidden.device.type == "cpu"


def test_cpu_dequantisation_is_exact_for_every_finite_code_and_keeps_nan_through_the_scale():
    codes = np.arange(256, dtype=np.uint8)
    exact = torch.from_numpy(codes).view(torch.float8_e4m3fn).float()  # torch's own cast: the definition
    finite = torch.isfinite(exact)
    assert int((~finite).sum()) == 2  # 0x7F and 0xFF, E4M3FN's NaNs
    for scale in (1.0, 0.37, 3e-5):
        got = dequantize_fp8(codes.reshape(256, 1, 1), np.full((256, 1), scale, np.float32), "float32")[:, 0, 0]
        assert torch.equal(got[finite], exact[finite] * np.float32(scale))
    nan_scale = np.full((256, 1), np.nan, np.float32)  # what quantize_fp8 writes beside a non-finite state
    assert torch.isnan(dequantize_fp8(codes.reshape(256, 1, 1), nan_scale, "float32")).all()


def test_restored_copy_stores_another_quantisers_encoding_verified(tmp_path):
    """``restored_copy(..., quantize=)`` (scripts/fp8_rounding_spread.py): a shifted scale is stored as given, the
    copy reads back verified, and its values are another E4M3 rounding of the same states."""
    x = _states(32, 5, 128)
    src = _write(tmp_path / "f32.h5", x, STORAGE_F32)

    def shifted(t):
        xf = t.float()
        scale = xf.abs().amax(-1) / FP8_MAX * 1.5
        return (xf / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8), scale

    plain = restored_copy(src, tmp_path / "fp8.h5", "fp8")
    other = restored_copy(src, tmp_path / "fp8_shift.h5", "fp8", quantize=shifted)
    with h5py.File(other) as f:
        np.testing.assert_allclose(f["samples/000000"][SCALE_DATASET][()], shifted(x)[1].numpy(), rtol=0)
    with CacheReader(plain) as a, CacheReader(other) as b:
        assert a.attrs["storage"] == b.attrs["storage"] == STORAGE_FP8
        ya, yb = a.sample(0).hidden, b.sample(0).hidden
    assert not torch.equal(ya, yb)  # the rounding grid moved
    for y, scale in ((ya, quantize_fp8(x)[1]), (yb, shifted(x)[1])):  # each within E4M3 rounding of the states
        bound = torch.maximum(x.abs() * 2.0 ** -4, scale[..., None] * 2.0 ** -10) * (1 + 1e-6)
        assert ((y - x).abs() <= bound).all()
