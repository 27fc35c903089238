"""The hidden-state cache writer alone: synthetic batches through the real PartialCache + StreamingWriter.

No model: each shape's batches (the stage's own packed ``length_batches`` over random lengths) are
filled with random bf16 bits in two reusable host buffers, exactly as ``extract._run_batches`` hands
them over, and pushed through :class:`dflash_eval.cache.writer.StreamingWriter` into a real sidecar that is
then finished (renamed into place). One run prints, per shape:

- tok/s and GB/s of the writer (first ``reserve`` to ``close``), and that rate over the GPU stage's
  (``--stage-tps``, the lead's H200 figure) as a ratio;
- the writer thread's own phase times (``StreamingWriter.timings``: waiting for the batch, hashing,
  HDF5 writes, commit/flush);
- a side-by-side breakdown of the per-sample pieces on the same data, each timed alone in one thread:
  sha256 of the stored bytes, the HDF5 data writes, the HDF5 objects and attributes, the flush;
- how much pure-Python work a main thread (standing in for the forward loop, which needs the GIL to
  launch kernels) gets done while the writer runs, relative to the same work with no writer.

CPU only (no torch kernels run). Here: ``.venv/bin/python bench/cache_writer.py`` (``--scale 0.25``
for a quick look); on the H200 host: ``python3 bench/cache_writer.py --out-dir /tmp/dflash-bench``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# ``--src DIR`` measures the dflash_eval package of another checkout (e.g. main's) with this script
_SRC = sys.argv[sys.argv.index("--src") + 1] if "--src" in sys.argv else str(REPO)
sys.path.insert(0, _SRC)

import numpy as np  # noqa: E402

#: name -> (samples, (min, max) tokens, stored layers K, hidden H, GPU stage tok/s measured on the H200)
SHAPES = {
    "smollm2-135m": (2048, (40, 630), 5, 576, 120_000),
    "llama-1.66b": (768, (64, 1600), 5, 2048, 72_000),
}


def _lengths(n: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(lo, hi + 1, size=n).tolist()


def _meta(lengths, vocab: int = 49152):
    from dflash_eval.cache.writer import SampleMeta

    rng = np.random.default_rng(1)
    out = []
    for i, T in enumerate(lengths):
        P = max(1, int(T * 0.4))
        out.append(SampleMeta(f"b{i}", rng.integers(4, vocab, size=T).astype(np.int32), P, "length", T - P))
    return out


def _identity(K: int, H: int, batch_tokens: int) -> dict:
    from dflash_eval.cache.format import FORMAT, FORMAT_VERSION, IDENTITY_ATTRS

    ident = {k: "bench" for k in IDENTITY_ATTRS}
    ident.update(format=FORMAT, format_version=FORMAT_VERSION, target_layer_ids=list(range(K)), hidden_size=H,
                 dtype="bfloat16", storage="uint16 raw bfloat16 bits", batching="packed", batch_tokens=batch_tokens)
    return ident


class _PyWork:
    """A pure-Python loop in the main thread (the forward loop's kernel launches need the GIL)."""

    def __init__(self):
        self.count = 0
        self.stop = False

    def run_for(self, seconds: float) -> float:
        t = time.perf_counter()
        n = 0
        while time.perf_counter() - t < seconds:
            for _ in range(1000):
                n += 1
        return n / (time.perf_counter() - t)


def run_writer(out: Path, lengths, K: int, H: int, batch_tokens: int, hash_threads: int | None,
               gil_probe: bool) -> dict:
    """Push every batch through PartialCache + StreamingWriter; the writer's timings and rates."""
    from dflash_eval.cache.writer import Batch, PartialCache, StreamingWriter
    from dflash_eval.core.runtime import length_batches

    meta = _meta(lengths)
    batches = length_batches(lengths, max_tokens=batch_tokens, packed=True)
    most = max(sum(lengths[i] for i in b) for b in batches)
    rng = np.random.default_rng(2)
    # two reusable host buffers, like extract._HostBuffers (random bf16 bits: the hash sees real entropy)
    bufs = [(rng.integers(0, 1 << 16, size=(most, K, H), dtype=np.uint16),
             rng.integers(0, 49152, size=most).astype(np.int32)) for _ in range(2)]
    free = list(bufs)
    cache = PartialCache(out, _identity(K, H, batch_tokens), meta)
    cache.path.unlink(missing_ok=True)
    cache.create({"format": "dflash-eval/hidden-state-cache"})
    t0 = time.perf_counter()
    writer = StreamingWriter(cache, max_batches=2, hash_threads=hash_threads)
    py_rate = 0.0
    probe_s = 0.0
    try:
        for b in batches:
            N = sum(lengths[i] for i in b)
            writer.reserve()
            buf = free.pop()
            samples, o = [], 0
            for i in b:
                T = lengths[i]
                samples.append((i, buf[0][o : o + T], buf[1][o : o + T]))
                o += T
            writer.hold(len(b), N)
            writer.submit(Batch(samples, "bfloat16", None, (lambda buf=buf: free.append(buf)), held=(len(b), N)))
            if gil_probe:  # stand-in for the next forward's Python work, while the writer writes this batch
                t = time.perf_counter()
                py_rate += _PyWork().run_for(0.004) * 0.004
                probe_s += time.perf_counter() - t
    finally:
        writer.close()
    secs = time.perf_counter() - t0
    cache.finish()
    size = out.stat().st_size
    tokens = sum(lengths)
    return {"seconds": secs, "tokens": tokens, "samples": len(lengths), "bytes": tokens * K * H * 2,
            "file_bytes": size, "timings": dict(getattr(writer, "timings", {})),
            "py_rate": py_rate / probe_s if probe_s else None, "batches": len(batches)}


def breakdown(tmp: Path, lengths, K: int, H: int, n: int) -> dict:
    """Per-sample costs of the pieces, each alone in one thread, on ``n`` samples of the shape."""

    from dflash_eval.cache.format import h5_writable

    rng = np.random.default_rng(3)
    ls = lengths[:n]
    hid = [rng.integers(0, 1 << 16, size=(T, K, H), dtype=np.uint16) for T in ls]
    arg = [rng.integers(0, 49152, size=T).astype(np.int32) for T in ls]
    ids = [rng.integers(0, 49152, size=T).astype(np.int32) for T in ls]
    res = {}
    t = time.perf_counter()
    for a, b, c in zip(ids, arg, hid):
        h = hashlib.sha256()
        for x in (a, b, c):
            h.update(memoryview(x).cast("B"))
        h.hexdigest()
    res["sha256 (1 thread)"] = time.perf_counter() - t
    t = time.perf_counter()
    for a, b, c in zip(ids, arg, hid):
        h = hashlib.blake2b(digest_size=32)
        for x in (a, b, c):
            h.update(memoryview(x).cast("B"))
        h.hexdigest()
    res["blake2b (1 thread, for comparison)"] = time.perf_counter() - t
    p = tmp / "pieces.h5"
    f = h5_writable(p, create=True)
    grp = f.create_group("samples")
    t = time.perf_counter()
    gs = [grp.create_group(f"{i:06d}") for i in range(n)]
    res["h5py: 1 group per sample"] = time.perf_counter() - t
    t = time.perf_counter()
    for g, a, b, c in zip(gs, ids, arg, hid):
        g.create_dataset("input_ids", data=a)
        g.create_dataset("hidden", data=c)
        g.create_dataset("target_argmax", data=b)
    res["h5py: 3 datasets per sample (create + data)"] = time.perf_counter() - t
    t = time.perf_counter()
    for g in gs:  # format 2: 8 attributes per sample
        g["hidden"].attrs["logical_dtype"] = "bfloat16"
        for k, v in (("sample_id", "b1"), ("prompt_len", 3), ("completion_len", 4), ("stop_reason", "length"),
                     ("max_new_tokens", 9), ("argmax_agreement", 1.0), ("sha256", "0" * 64)):
            g.attrs[k] = v
    res["h5py: 8 attributes per sample (format 2)"] = time.perf_counter() - t
    t = time.perf_counter()
    for g in gs:  # format 3: the checksum only
        g.attrs["sha256_3"] = "0" * 64
    res["h5py: 1 attribute per sample (format 3)"] = time.perf_counter() - t
    t = time.perf_counter()
    f.flush()
    res["h5py: flush"] = time.perf_counter() - t
    f.close()
    p.unlink()
    t = time.perf_counter()
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for x in hid:
        os.write(fd, memoryview(x).cast("B"))
    os.close(fd)
    res["os.write of the hidden bytes to a fresh file (floor)"] = time.perf_counter() - t
    p.unlink()
    # the same bytes as one contiguous write (what a flat layout would cost)
    f = h5_writable(p, create=True)
    total = sum(ls)
    d = f.create_dataset("hidden", shape=(total, K, H), dtype=np.uint16)
    cat = np.concatenate(hid)
    t = time.perf_counter()
    d[:] = cat
    res["h5py: all samples' hidden as one write (reference)"] = time.perf_counter() - t
    t = time.perf_counter()
    np.copyto(np.empty_like(cat), cat)
    res["memcpy of the same bytes (reference)"] = time.perf_counter() - t
    f.close()
    p.unlink()
    return {k: v / n * 1e3 for k, v in res.items()}  # ms per sample


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {list(SHAPES)}")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of each shape's samples (default 1)")
    ap.add_argument("--out-dir", default=None, help="where the caches go (default: a temp dir; /dev/shm takes the "
                                                     "disk out)")
    ap.add_argument("--batch-tokens", type=int, default=None, help="default: the config schema's cache.batch_tokens")
    ap.add_argument("--hash-threads", type=int, default=None, help="default: the writer's default")
    ap.add_argument("--breakdown-samples", type=int, default=200)
    ap.add_argument("--src", default=str(REPO), help="checkout whose dflash_eval is measured (default: this one)")
    a = ap.parse_args()
    from dflash_eval.core.schema import schema_default

    bt = a.batch_tokens or schema_default("cache.batch_tokens")
    root = Path(a.out_dir or tempfile.mkdtemp(prefix="dflash-writer-"))
    root.mkdir(parents=True, exist_ok=True)
    base = _PyWork().run_for(0.5)
    import dflash_eval.cache.format as C

    print(f"cache writer alone (no model), CPU: {os.cpu_count()} cores; batch_tokens {bt}; outputs under {root}; "
          f"dflash_eval from {Path(C.__file__).parent}")
    for name in a.shapes.split(","):
        n, (lo, hi), K, H, stage_tps = SHAPES[name]
        n = max(2, int(n * a.scale))
        lengths = _lengths(n, lo, hi)
        out = root / f"{name}.h5"
        r = run_writer(out, lengths, K, H, bt, a.hash_threads, gil_probe=True)
        tps, gbs = r["tokens"] / r["seconds"], r["bytes"] / r["seconds"] / 1e9
        print(f"\n{name}: {n} samples, {r['tokens']:,} tokens, K={K}, H={H}, bf16, {r['batches']} batches; "
              f"{r['bytes'] / 1e9:.2f} GB of states, file {r['file_bytes'] / 1e9:.2f} GB")
        print(f"  writer: {tps:12,.0f} tok/s  {gbs:6.2f} GB/s  {r['seconds'] / n * 1e3:6.3f} ms/sample  "
              f"({tps / stage_tps:.2f}x the H200 stage's {stage_tps:,} tok/s)")
        if r["timings"]:
            print("  writer thread phases (s): " + ", ".join(f"{k} {v:.2f}" for k, v in r["timings"].items()))
        if r["py_rate"]:
            print(f"  main-thread Python work while the writer runs: {100 * r['py_rate'] / base:.0f} % of its rate "
                  "alone (GIL and cores left to the forward loop)")
        bd = breakdown(root, lengths, K, H, min(a.breakdown_samples, n))
        print(f"  pieces alone, one thread, ms/sample (mean {np.mean(lengths[: a.breakdown_samples]):.0f} tokens):")
        for k, v in bd.items():
            print(f"    {k:52s} {v:7.3f}")
        out.unlink()


if __name__ == "__main__":
    main()
