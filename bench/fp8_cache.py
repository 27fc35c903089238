"""FP8 hidden-state caches (``cache.storage: fp8``) against bf16 ones of the same completions: size, read cost, error.

A random target of a real model's shape is built on the device from a config (no weights to download), random
completions of ``--tokens`` tokens in all are run through it by the hidden_states stage's own batch loop
(:func:`dflash_eval.stages.hidden_states._run_batches`: the forward, the device-side quantisation, the pinned
host buffers, the streaming writer) once per storage, and each cache is read back the way evaluate reads it
(:meth:`dflash_eval.cache.reader.CacheReader.verified_samples`: checksum and finite scan in threads, FP8
dequantised in the same threads) and without verification (``verify=False``: HDF5 read + conversion). Printed
side by side, one warm-up pass untimed, then ``--rounds`` rounds interleaved, the minimum of each:

- ``bytes``: the file sizes and ``size_ratio`` = bf16 / fp8 (goal >= 1.9);
- ``read_s`` / ``read_unverified_s`` and ``read_ratio`` = fp8 / bf16 (goal <= 1.0), each read ending with every
  sample's states on the device (``.to(device)``, as the replay moves them; FP8 dequantised there:
  ``CacheReader(dequant_device=...)``), in the replay's dtype (bf16 on CUDA, float32 on the CPU, as evaluate's
  replay widens them); on the GPU also ``read_ratio_cpu_dequant`` (FP8 dequantised on the CPU,
  then copied);
- ``cpu_dequant_s``: the CPU dequantisation alone (the stored arrays read beforehand), ours against torch's
  float8 cast and a 256-entry table look-up (:func:`cpu_dequant_times`);
- ``rel_l2``: per stored layer, ||fp8 - ref|| / ||ref|| over every token (ref: the bf16 cache; on the CPU also
  the float32 cache, the demo's own storage).

On the GPU both caches come from bf16 states (the stage's CUDA default); on the CPU (``--smoke``, or
``--device cpu``) the bf16 cache is made from the float32 forward (``cache.dtype: bfloat16``), the FP8 one from
the float32 states (the demo's ``cache.storage: fp8``), and a float32 cache too.

GPU host (one command, < 3 min: ``--shape llama-8b``, Llama-3-8B's layout, 4,096 tokens)::

    PYTHONPATH=$PWD python3 bench/fp8_cache.py --out-dir /tmp/fp8-bench --out fp8_cache.json

``--smoke``: a tiny shape on the CPU in seconds (``tests/bench/test_bench_fp8_cache.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

try:
    import tenacity  # noqa: F401
except ImportError:  # a minimal GPU environment: only serving clients use it (at run time), never this bench
    import types

    sys.modules["tenacity"] = types.ModuleType("tenacity")

import h5py  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from dflash_eval.cache.format import (FORMAT, FORMAT_VERSION, STORAGE_BF16, STORAGE_F32, STORAGE_FP8,  # noqa: E402
                                      dequantize_fp8, from_storage)
from dflash_eval.cache.reader import CacheReader  # noqa: E402
from dflash_eval.cache.writer import PartialCache, SampleMeta  # noqa: E402
from dflash_eval.core.runtime import length_batches, resolve_dtype  # noqa: E402
from dflash_eval.stages.hidden_states import _run_batches  # noqa: E402

#: name -> (LlamaConfig keywords, stored layers, (min, max) tokens per sample)
SHAPES = {
    # meta-llama/Meta-Llama-3-8B config.json: hidden 4096, 32 layers, 32/8 heads, intermediate 14336, vocab 128256
    "llama-8b": (dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
                 [1, 8, 15, 22, 29], (256, 768)),
    # HuggingFaceTB/SmolLM2-135M-Instruct config.json (the demo target's layout) and the demo caches' layers
    "smollm2": (dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True),
                [1, 8, 15, 22, 27], (128, 384)),
    "smoke": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=512), [1, 3], (16, 48)),
}


def build_target(shape: str, dev: torch.device, dt: torch.dtype, seed: int = 0):
    """A random ``LlamaForCausalLM`` of ``shape`` made on ``dev`` in ``dt`` (no host copy of the weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**SHAPES[shape][0], attn_implementation="sdpa")
    old = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        with dev:
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    for p in model.parameters():  # transformers' own init is slow at this size: a plain N(0, 0.02)
        p.data.normal_(0.0, 0.02) if p.dim() > 1 else p.data.fill_(1.0)
    return model.eval()


def completions(shape: str, tokens: int, seed: int = 0) -> list[list[int]]:
    """Random token sequences of SHAPES' lengths, ``tokens`` in all (at least)."""
    rng = np.random.default_rng(seed)
    vocab, (lo, hi) = SHAPES[shape][0]["vocab_size"], SHAPES[shape][2]
    seqs, n = [], 0
    while n < tokens:
        T = int(rng.integers(lo, hi + 1))
        seqs.append(rng.integers(0, vocab, size=T).tolist())
        n += T
    return seqs


def write(path: Path, model, seqs, layer_ids, dev, dt, fp8: bool, batch_tokens: int) -> float:
    """The cache of ``seqs`` at ``path`` through the stage's batch loop; seconds taken."""
    storage = STORAGE_FP8 if fp8 else STORAGE_BF16 if dt == torch.bfloat16 else STORAGE_F32
    meta = [SampleMeta(f"s{i}", np.asarray(s, dtype=np.int32), len(s) // 4, "length", len(s) - len(s) // 4)
            for i, s in enumerate(seqs)]
    identity = {"format": FORMAT, "format_version": FORMAT_VERSION, "target_layer_ids": list(layer_ids),
                "hidden_size": model.config.hidden_size, "dtype": str(dt).removeprefix("torch."), "storage": storage}
    cache = PartialCache(path, identity, meta)
    cache.create({**identity, "num_target_layers": model.config.num_hidden_layers})
    batches = length_batches([len(s) for s in seqs], max_tokens=batch_tokens)
    t0 = time.perf_counter()
    _run_batches(model, cache, seqs, batches, list(layer_ids), dev, dt, 0, False, fp8)
    cache.finish()
    return time.perf_counter() - t0


def read_all(path: Path, verify: bool, device: torch.device, dequant_on_device: bool = True) -> float:
    """Seconds to read every sample of ``path`` as evaluate does (``verified_samples``), or unverified, and bring
    its states to ``device`` in the replay's dtype (evaluate's replay reads them there, as
    ``.to(device=dev, dtype=dt)``: bf16 on CUDA, float32 on the CPU, so a bf16 cache read on the CPU pays its
    conversion as the replay does); FP8 caches are dequantised there, or on the CPU (``dequant_on_device`` False)
    and then copied."""
    dt = resolve_dtype("auto", device)
    t0 = time.perf_counter()
    with CacheReader(path, verify=verify, dequant_device=device if dequant_on_device else None) as rd, \
            rd.verified_samples(range(len(rd))) as samples:
        on = [s.hidden.to(device=device, dtype=dt) for s in samples]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        assert len(on) == len(rd)
    return time.perf_counter() - t0


def stored_states(path: Path) -> np.ndarray:
    """Every sample's states as float64 ``[sum T, K, H]`` (dequantised / converted as the reader does)."""
    out = []
    with h5py.File(path, "r") as f:
        fp8 = f.attrs["storage"] == STORAGE_FP8
        for name in sorted(f["samples"]):
            g = f["samples"][name]
            h = g["hidden"][()]
            x = (dequantize_fp8(h, g["hidden_scale"][()], "float32") if fp8
                 else from_storage(h, "bfloat16" if h.dtype == np.uint16 else "float32").float())
            out.append(x.double().numpy())
    return np.concatenate(out)


def cpu_dequant_times(path: Path, rounds: int) -> dict[str, float]:
    """Seconds (minimum of ``rounds``, one warm-up) to dequantise every FP8 sample of ``path`` on the CPU to
    float32 ``[T, K, H]`` three ways: ``ours`` (:func:`~dflash_eval.cache.format.dequantize_fp8`'s float16 bit
    placement), ``float8_cast`` (torch's ``view(float8_e4m3fn).float()`` then the scale's product, the loop a user
    would write first) and ``table`` (numpy ``take`` from the 256 float32 values of the codes, then the product).
    The stored arrays are read once beforehand: only the dequantisation is timed."""
    with h5py.File(path, "r") as f:
        raw = [(f["samples"][n]["hidden"][()], f["samples"][n]["hidden_scale"][()]) for n in sorted(f["samples"])]
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    ways = {
        "ours": lambda q, s: dequantize_fp8(q, s, "float32"),
        "float8_cast": lambda q, s: torch.from_numpy(q).view(torch.float8_e4m3fn).float().mul_(
            torch.from_numpy(s)[..., None]),
        "table": lambda q, s: np.multiply(np.take(table, q), s[..., None]),
    }
    best = {}
    for name, fn in ways.items():
        ts = []
        for _ in range(rounds + 1):
            t0 = time.perf_counter()
            for q, s in raw:
                fn(q, s)
            ts.append(time.perf_counter() - t0)
        best[name] = min(ts[1:])
    return best


def rel_l2(a: np.ndarray, ref: np.ndarray) -> list[float]:
    return [float(np.linalg.norm(a[:, k] - ref[:, k]) / np.linalg.norm(ref[:, k])) for k in range(ref.shape[1])]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    p.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    p.add_argument("--tokens", type=int, default=4096, help="prompt + completion tokens in all")
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out-dir", default=None, help="where the caches are written (default: a temporary folder)")
    p.add_argument("--out", default=None, help="also write the JSON row here")
    p.add_argument("--smoke", action="store_true", help="tiny shape on the CPU, 2 rounds")
    a = p.parse_args(argv)
    if a.smoke:
        a.shape, a.device, a.tokens, a.rounds, a.batch_tokens = "smoke", "cpu", 600, 2, 256
    dev = torch.device(a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    out_dir = Path(a.out_dir or tempfile.mkdtemp(prefix="fp8-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    layer_ids = SHAPES[a.shape][1]
    t0 = time.perf_counter()
    model = build_target(a.shape, dev, torch.bfloat16 if cuda else torch.float32)
    build_s = time.perf_counter() - t0
    seqs = completions(a.shape, a.tokens)
    # (name, state dtype, fp8): on the GPU the stage's bf16 states; on the CPU the demo's float32 ones
    plan = ([("bf16", torch.bfloat16, False), ("fp8", torch.bfloat16, True)] if cuda else
            [("f32", torch.float32, False), ("bf16", torch.bfloat16, False), ("fp8", torch.float32, True)])
    paths, write_s = {}, {}
    for name, dt, fp8 in plan:
        paths[name] = out_dir / f"{name}.h5"
        paths[name].unlink(missing_ok=True)
        write_s[name] = write(paths[name], model, seqs, layer_ids, dev, dt, fp8, a.batch_tokens)
    del model
    if cuda:
        torch.cuda.empty_cache()
    sizes = {k: os.path.getsize(v) for k, v in paths.items()}
    first = {k: read_all(v, True, dev) for k, v in paths.items()}  # warm-up (page cache, pools), reported apart
    times = {(k, v): [] for k in paths for v in (True, False)}
    for _ in range(a.rounds):  # interleaved: the noise of a shared host hits every variant alike
        for k in paths:
            for v in (True, False):
                times[(k, v)].append(read_all(paths[k], v, dev))
    if cuda:  # FP8 dequantised on the CPU, then copied: what a reader without dequant_device costs
        cpu_deq = [read_all(paths["fp8"], True, dev, dequant_on_device=False) for _ in range(a.rounds)]
    best = {k: min(t) for k, t in times.items()}
    ref = stored_states(paths["bf16"])
    fp8_states = stored_states(paths["fp8"])
    row = {
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "shape": a.shape, "layers": layer_ids,
        "hidden_size": SHAPES[a.shape][0]["hidden_size"], "samples": len(seqs), "tokens": int(sum(map(len, seqs))),
        "build_target_s": round(build_s, 2), "write_s": {k: round(v, 3) for k, v in write_s.items()},
        "bytes": sizes, "size_ratio": round(sizes["bf16"] / sizes["fp8"], 3),
        "read_first_s": {k: round(v, 4) for k, v in first.items()},
        "read_s": {k: round(best[(k, True)], 4) for k in paths},
        "read_unverified_s": {k: round(best[(k, False)], 4) for k in paths},
        "read_ratio": round(best[("fp8", True)] / best[("bf16", True)], 3),
        "read_unverified_ratio": round(best[("fp8", False)] / best[("bf16", False)], 3),
        **({"read_fp8_cpu_dequant_s": round(min(cpu_deq), 4),
            "read_ratio_cpu_dequant": round(min(cpu_deq) / best[("bf16", True)], 3)} if cuda else {}),
        "rel_l2_vs_bf16": [round(x, 5) for x in rel_l2(fp8_states, ref)],
        "torch_threads": torch.get_num_threads(),
    }
    deq = cpu_dequant_times(paths["fp8"], a.rounds)
    row["cpu_dequant_s"] = {k: round(v, 5) for k, v in deq.items()}
    if "f32" in paths:
        f32 = stored_states(paths["f32"])
        row["rel_l2_vs_f32"] = [round(x, 5) for x in rel_l2(fp8_states, f32)]
        row["rel_l2_bf16_vs_f32"] = [round(x, 5) for x in rel_l2(ref, f32)]
    print(f"{row['device']}: {row['shape']} (hidden {row['hidden_size']}, {len(layer_ids)} stored layers), "
          f"{row['samples']} samples, {row['tokens']} tokens; target built in {build_s:.1f} s")
    for k in paths:
        print(f"  {k:5s} {sizes[k] / 1e6:9.2f} MB  write {write_s[k]:7.3f} s  read verified {best[(k, True)]:.4f} s "
              f"(first {first[k]:.4f} s)  unverified {best[(k, False)]:.4f} s")
    print(f"  size ratio bf16 / fp8: {row['size_ratio']:.3f} (goal >= 1.9)")
    print(f"  read ratio fp8 / bf16: verified {row['read_ratio']:.3f}, unverified {row['read_unverified_ratio']:.3f} "
          "(goal <= 1.0)")
    if cuda:
        print(f"  fp8 dequantised on the CPU instead, then copied: verified {min(cpu_deq):.4f} s, "
              f"ratio fp8 / bf16 {row['read_ratio_cpu_dequant']:.3f}")
    print(f"  CPU dequantisation of every sample (torch threads {row['torch_threads']}): ours {deq['ours']:.4f} s, "
          f"torch float8 cast {deq['float8_cast']:.4f} s ({deq['float8_cast'] / deq['ours']:.1f}x ours), "
          f"table look-up {deq['table']:.4f} s ({deq['table'] / deq['ours']:.1f}x ours)")
    print(f"  rel-L2 fp8 vs bf16 per layer: {row['rel_l2_vs_bf16']}")
    if "rel_l2_vs_f32" in row:
        print(f"  rel-L2 vs float32: fp8 {row['rel_l2_vs_f32']}, bf16 {row['rel_l2_bf16_vs_f32']}")
    print(json.dumps(row))
    if a.out:
        Path(a.out).write_text(json.dumps(row, indent=1))
    return row


if __name__ == "__main__":
    main()
