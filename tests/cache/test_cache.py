"""HDF5 cache: bit-exact bf16 round trip, attributes, hook capture == HF hidden_states[i+1]."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from dflash_eval.cache.format import FILE_ATTRS, from_storage, to_storage, write_header
from dflash_eval.cache.reader import CacheReader
from dflash_eval.cache.writer import write_cache
from dflash_eval.cache.extract import run_target
from dflash_eval.core.runtime import length_batches
from dflash_eval.core.errors import InputError


def test_bf16_round_trip_is_bit_exact(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 3, 16, generator=g) * 100).to(torch.bfloat16)
    x[0, 0, :4] = torch.tensor([float("inf"), -0.0, 1e-40, float("nan")]).to(torch.bfloat16)
    arr, logical = to_storage(x)
    assert arr.dtype == np.uint16 and logical == "bfloat16"
    attrs = {"format": "dflash-eval/hidden-state-cache", "format_version": 6, "target_layer_ids": [1, 2, 5],
             "hidden_size": 16, "num_target_layers": 6}
    sample = {"sample_id": "HumanEval/0", "input_ids": list(range(37)), "prompt_len": 10, "hidden": x,
              "target_argmax": np.arange(37), "stop_reason": "eos", "max_new_tokens": 64, "argmax_agreement": 1.0}
    write_cache(tmp_path / "c.h5", attrs, [sample])
    with CacheReader(tmp_path / "c.h5") as rd, pytest.raises(InputError, match="non-finite hidden state"):
        rd.sample(0)  # a verified read refuses the inf/NaN (tests/cache/test_reliability.py); the storage keeps them:
    with CacheReader(tmp_path / "c.h5", verify=False) as rd:
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
        write_cache(tmp_path / "c.h5", {"format": "dflash-eval/hidden-state-cache", "format_version": 6,
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


def test_file_attrs_listed():
    assert {"target_sha256", "target_layer_ids", "dtype", "device", "torch_version", "transformers_version",
            "fla_version", "linear_attn_kernel"} <= set(FILE_ATTRS)


# --------------------------------------------------------------------------- packed forward
def _tiny_lm(arch: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=128, initializer_range=0.2)
    cfg, cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen3Config, Qwen3ForCausalLM)
    model = cls(cfg(**common, attn_implementation="sdpa")).eval()
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_packed_matches_padded_and_hf(arch):
    """Packed samples (one sequence, per-sample causal attention via cu_seqlens, positions restarting at 0)
    give HF's hidden_states[i+1] of each sample alone, like the right-padded batch (float32, CPU)."""
    from dflash_eval.cache.extract import check_packing

    model = _tiny_lm(arch)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (23, 7, 1, 40, 12)]
    layer_ids = [0, 2, 3]
    packed = run_target(model, seqs, layer_ids, "cpu", packed=True)
    padded = run_target(model, seqs, layer_ids, "cpu", packed=False)
    worst = 0.0
    for seq, (hp, ap), (hq, aq) in zip(seqs, packed, padded):
        with torch.no_grad():
            ref = model(torch.tensor([seq]), output_hidden_states=True)
        for k, i in enumerate(layer_ids):
            torch.testing.assert_close(hp[:, k], ref.hidden_states[i + 1][0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(hq[:, k], ref.hidden_states[i + 1][0], rtol=1e-5, atol=1e-5)
            worst = max(worst, float((hp[:, k] - hq[:, k]).abs().max()))
        assert torch.equal(ap, ref.logits[0].argmax(-1)) and torch.equal(aq, ap)
    assert worst < 1e-5
    assert model.config._attn_implementation == "sdpa"  # restored after the packed forward
    assert check_packing(model, seqs, layer_ids, "cpu") < 1e-5


def test_packing_support():
    from dflash_eval.cache.extract import packing_support
    from dflash_eval.target.spec import TargetSpec

    def spec(**cfg):
        base = {"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 10}
        return TargetSpec(path=None, config={**base, **cfg}, model_type=cfg.get("model_type", ""), num_layers=2,
                          hidden_size=8, vocab_size=10, layer_types=tuple(cfg.get("layer_types", ())))

    assert packing_support(spec(model_type="llama"))[0]
    assert packing_support(spec(model_type="qwen3", sliding_window=4096, use_sliding_window=False))[0]
    assert not packing_support(spec(model_type="mistral", sliding_window=4096))[0]
    assert not packing_support(spec(model_type="qwen3_5", layer_types=["linear_attention", "full_attention"]))[0]
    assert not packing_support(spec(model_type="gemma2"))[0]


# --------------------------------------------------------------------------- reader: locks, damage, checksums
def _small_cache(path):
    x = torch.randn(5, 2, 8).to(torch.bfloat16)
    write_cache(path, {"format": "dflash-eval/hidden-state-cache", "format_version": 6, "target_layer_ids": [0, 1]},
                [{"sample_id": f"s{i}", "input_ids": [1, 2, 3, 4, 5], "prompt_len": 2, "hidden": x * i,
                  "target_argmax": [2, 3, 4, 5, 6], "stop_reason": "eos", "max_new_tokens": 8} for i in range(3)])
    return path


def test_reader_ignores_locks_and_names_damage(tmp_path):
    import subprocess
    import sys

    cache = _small_cache(tmp_path / "c.h5")
    # Another process holds the file open for writing (HDF5's exclusive lock): readers are not stopped.
    holder = subprocess.Popen([sys.executable, "-c", "import h5py, sys; f = h5py.File(sys.argv[1], 'r+'); "
                               "print('open', flush=True); sys.stdin.read()", str(cache)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(OSError, match="unable to lock file"):
            h5py.File(cache, "r")  # what readers used to do
        with CacheReader(cache) as rd:
            assert len(rd) == 3 and rd.sample(2).sample_id == "s2" and rd.verify() == []
    finally:
        holder.communicate("")
    data = cache.read_bytes()
    (tmp_path / "t.h5").write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="damaged HDF5 file: truncated") as err:
        CacheReader(tmp_path / "t.h5")
    assert "re-extract" in err.value.fix
    (tmp_path / "n.h5").write_bytes(b"not hdf5" * 100)
    with pytest.raises(InputError, match="not an HDF5 file"):
        CacheReader(tmp_path / "n.h5")
    with h5py.File(tmp_path / "u.h5", "w") as f:  # an unfinished cache (a partial renamed by hand)
        f.attrs.update({"format": "dflash-eval/hidden-state-cache", "format_version": 6, "target_layer_ids": [0]})
        f["sample_ids"] = np.array(["a", "b"], dtype=object).astype(h5py.string_dtype())
        f.create_group("samples")
        write_header(f.attrs)
    with pytest.raises(InputError, match="unfinished cache: 0 of 2 samples") as err:
        CacheReader(tmp_path / "u.h5")
    assert "delete" not in err.value.fix


def test_verify_finds_a_flipped_bit(tmp_path):
    cache = _small_cache(tmp_path / "c.h5")
    with h5py.File(cache, "r+") as f:
        d = f["samples/000001/hidden"]
        arr = d[()]
        arr[3, 1, 5] ^= 1
        d[...] = arr
    with CacheReader(cache) as rd:
        assert rd.verify() == [1]


# --------------------------------------------------------------------------- documented == written
def _documented():
    """Names docs/cache-format.md ("The file in full") documents: file attributes, sample datasets, sample attributes."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "cache-format.md").read_text(encoding="utf-8")
    doc = page[page.index("## The file in full"):]
    files_part = doc[doc.index("File attributes (FILE_ATTRS"): doc.index("Layer convention")]
    items = re.split(r"\n- ", files_part)[1:]
    file_attrs = {n for item in items for n in re.findall(r"``([a-z0-9_]+)``", " ".join(item.split()).split(": ")[0])}
    top = doc[doc.index("File layout"): doc.index("/samples/<i:06d>/")]
    file_datasets = set(re.findall(r"^ {4}/([a-z_]+) +\[", top, flags=re.M))
    layout = doc[doc.index("/samples/<i:06d>/"): doc.index("File attributes (FILE_ATTRS")]
    datasets = set(re.findall(r"^ {8}([a-z_]+) +\[", layout, flags=re.M))
    sample_attrs = set(re.findall(r"^ {12}([a-z0-9_]+) {2,}", layout, flags=re.M))
    return file_attrs, file_datasets, datasets, sample_attrs


def test_documented_attributes_are_the_written_ones(tmp_path):
    """docs/cache-format.md lists exactly what a real extraction writes (file attrs, datasets, sample attrs)."""
    import json
    import sys
    from pathlib import Path

    from dflash_eval.cache.format import FILE_DATASETS, SAMPLE_ATTRS, SAMPLE_DATASETS, SCALE_DATASET, STORAGE_FP8
    from dflash_eval.stages.hidden_states import extract_hidden_states

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny import make_tiny_target

    target = make_tiny_target(tmp_path / "t", num_layers=2, hidden=32)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"id": f"x{i}", "prompt_ids": [5, 6, 7][: i + 1],
                                                          "completion_ids": [8, 9], "stop_reason": "eos",
                                                          "max_new_tokens": 4}) + "\n" for i in range(3)))
    out = extract_hidden_states(target, tmp_path / "c.jsonl", tmp_path / "c.h5", [0, 1], device="cpu")
    file_doc, file_ds_doc, ds_doc, sample_doc = _documented()
    with h5py.File(out, "r", locking=False) as f:
        assert set(f.attrs) == file_doc == set(FILE_ATTRS)
        assert set(f) == file_ds_doc | {"samples"} == {"sample_ids", "samples", *FILE_DATASETS}
        assert f["prompt_len"][()].tolist() == [1, 2, 3] and f["completion_len"][()].tolist() == [2, 2, 2]
        assert f["max_new_tokens"][()].tolist() == [4, 4, 4] and f["argmax_agreement"].dtype == np.float64
        assert [s.decode() for s in f["stop_reason"][()]] == ["eos"] * 3
        assert not np.isnan(f["argmax_agreement"][()]).any()
        for name, g in f["samples"].items():
            assert set(g) == ds_doc - {SCALE_DATASET} == set(SAMPLE_DATASETS)
            assert set(g.attrs) == sample_doc == set(SAMPLE_ATTRS)
            assert set(g["hidden"].attrs) == set()
            assert len(g["input_ids"]) - f["prompt_len"][int(name)] == f["completion_len"][int(name)]
    with CacheReader(out) as rd:
        assert rd.verify() == []
    fp8 = extract_hidden_states(target, tmp_path / "c.jsonl", tmp_path / "f.h5", [0, 1], device="cpu", storage="fp8")
    with h5py.File(fp8, "r", locking=False) as f:  # cache.storage: fp8 adds hidden_scale, nothing else
        assert set(f.attrs) == file_doc and f.attrs["storage"] == STORAGE_FP8 and f.attrs["dtype"] == "float32"
        for g in f["samples"].values():
            assert set(g) == ds_doc and g["hidden"].dtype == np.uint8 and g[SCALE_DATASET].shape == (len(g["input_ids"]), 2)
    with CacheReader(fp8) as rd, CacheReader(out) as ref:
        assert rd.verify() == []
        for i in range(3):
            a, b = rd.sample(i).hidden, ref.sample(i).hidden
            assert ((a - b).norm() / b.norm()).item() < 0.05


def test_resume_salvages_a_partial_whose_group_index_is_damaged(tmp_path, caplog):
    """A sample group whose object header never reached the disk (a kill between metadata writes): it
    cannot be opened nor unlinked, so the verified samples are copied to a fresh file and the rest recomputed."""
    from dflash_eval.cache.format import IDENTITY_ATTRS, sample_meta_json, sample_sha256
    from dflash_eval.cache.writer import PartialCache, SampleMeta

    meta = [SampleMeta(f"s{i}", np.arange(5, dtype=np.int32) + i, 2, "eos", 8) for i in range(4)]
    identity = {k: 1 for k in IDENTITY_ATTRS} | {"format": "dflash-eval/hidden-state-cache", "format_version": 6,
                                                "target_layer_ids": [0]}
    arrays = [(np.full((5, 1, 4), i, dtype=np.float32), np.arange(5, dtype=np.int32)) for i in range(4)]

    def write(cache, i):
        h, a = arrays[i]
        m = sample_meta_json(f"s{i}", 2, 3, "eos", 8, 1.0)
        cache.write_sample(i, h, "float32", a, sample_sha256(meta[i].input_ids, a, h, m), 1.0)

    cache = PartialCache(tmp_path / "c.h5", identity, meta)
    cache.create({})
    for i in range(4):
        write(cache, i)
    cache.commit()
    addr = h5py.h5o.get_info(cache._f["samples/000003"].id).addr
    cache.close()
    with open(cache.path, "r+b") as fh:  # destroy sample 3's object header
        fh.seek(addr)
        fh.write(b"\0" * 64)
    caplog.set_level("WARNING")
    again = PartialCache(tmp_path / "c.h5", identity, meta)
    assert again.resume() == {0, 1, 2}
    assert "copying the 3 verified samples to a fresh file" in caplog.text
    write(again, 3)
    again.commit()
    again.finish()
    with CacheReader(tmp_path / "c.h5") as rd:
        assert len(rd) == 4 and rd.verify() == [] and float(rd.sample(3).hidden[0, 0, 0]) == 3.0
