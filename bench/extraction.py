"""Hidden-state extraction: dflash-eval's hidden-states stage vs the plain HF loop a user would write.

For each model (random weights from a transformers config), on the same synthetic completions and layers, it prints:

- tok/s of ``python -m dflash_eval hidden-states`` (the stage as the workflow runs it: packed
  batches, pinned copies, writer thread, per-sample sha256, the HDF5 cache written to ``--out-dir``;
  timed from its first batch to its last commit, model loading excluded) and of the plain loop
  (``output_hidden_states`` over length-sorted right-padded batches, the stored layers copied per sample into
  pinned host buffers, one sync per batch; nothing  written), and of the forward-only ceiling (the same batches through the model with no states kept
  and no copies); the stage's ratio to both, and the useful TFLOP/s of each against a bf16 (fp32 on
  CPU) GEMM rate measured here;
- the cache writer thread's busy time against the stage's, and a note on any SDPA fallback of packed attention;
- the cache's agreement with the loop (max relative L2 of the stored states per sample, argmax agreement);
- peak RSS of the stage for ``--rss-samples`` samples and for 4x as many (streaming: it must not grow).

Useful FLOPs per sample of T tokens: 2 x (parameters without the input embedding, LM head included) x T
plus the causal attention scores, 2 x n_layers x hidden x T^2 (padding not counted, for either side).

``--models hybrid-7b,llama-8b``: the user-scale pair (an 8.16B Qwen3.5-style hybrid with fla kernels and an 8.03B
llama; docs/measurements.md, "The target stages on a user-scale hybrid"); ``bench/hybrid_gpu.sh`` runs both.

``--kernel-parity N``: only the ``kernel_parity`` stage against its two extractions (docs/measurements.md,
"The kernel_parity stage against its two extractions", has the method and the commands).

CPU smoke test (tiny models, float32, a minute here): ``.venv/bin/python bench/extraction.py --smoke``
On one H200 (torch 2.11, transformers 5.17, h5py; no network), from the repository root:

    python3 bench/extraction.py --out-dir /tmp/dflash-bench

(``--out-dir`` on a local disk; ~17 GB at peak for the 1.66B model's caches; ``/dev/shm`` if it is large
enough takes the disk out of the measurement.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

#: name -> (transformers LlamaConfig kwargs, samples, (min, max) tokens per sample, stored layers, loop batch)
MODELS = {
    "smollm2-135m": (dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                          max_position_embeddings=8192), 2048, (40, 630), [1, 8, 15, 22, 27], 64),
    "llama-1.66b": (dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=49152, tie_word_embeddings=False, rope_theta=100000.0,
                         max_position_embeddings=8192), 768, (64, 1600), [1, 6, 12, 18, 23], 32),
    # user scale (issue #43): an 8.2B Qwen3.5-style hybrid (fla kernels on CUDA) and the 8.0B llama beside it;
    # samples of 128-1200 tokens, the loop's batch ~32k padded tokens (what a user's loop used)
    "hybrid-7b": ("HYBRID_7B", 96, (128, 1200), [1, 9, 17, 25, 31], 24),
    "llama-8b": ("LLAMA_8B", 96, (128, 1200), [1, 9, 17, 25, 31], 24),
}
SMOKE = {
    "smollm2-135m": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=384, tie_word_embeddings=True,
                          max_position_embeddings=512), 24, (8, 120), [1, 3], 8),
    "llama-1.66b": (dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=384, tie_word_embeddings=False,
                         max_position_embeddings=512), 16, (16, 200), [0, 3], 4),
    "hybrid-7b": ("TINY_HYBRID", 12, (16, 120), [1, 3], 4),
    "llama-8b": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=384, tie_word_embeddings=False,
                      max_position_embeddings=512), 12, (16, 120), [1, 3], 4),
}


def model_config(cfg):
    """``(kind, config kwargs)`` of a table entry: named entries are tests/tiny_hybrid.py's bench shapes."""
    import tiny_hybrid as th

    if cfg == "TINY_HYBRID":
        return "hybrid", dict(th.TEXT_KW, bos_token_id=0, eos_token_id=2, pad_token_id=3)
    if cfg == "HYBRID_7B":
        return "hybrid", dict(th.HYBRID_7B)
    if cfg == "LLAMA_8B":
        return "llama", dict(th.LLAMA_8B)
    return "llama", dict(cfg)


def build_target(out: Path, cfg, seed: int = 0, over: dict | None = None) -> dict:
    """A random-init target saved in bf16 with a small byte-level tokenizer (ids beyond it are fine: extraction
    never decodes): a LlamaForCausalLM, or a Qwen3_5ForCausalLM for hybrid entries. Built on the GPU in bf16 when
    there is one (an 8B model never sits in float32 on the host), its memory given back to the GPU afterwards.
    ``over``: config values replacing the entry's (e.g. ``max_position_embeddings`` for long contexts).

    Returns:
        ``{"kind", "cfg" (config kwargs), "dense_params" (parameters without the input embedding, LM head
        included), "attn_layers" (full-attention layers), "attn_width" (query heads x head dim), "build_s"}``.
    """
    import torch
    import tiny_hybrid as th
    from tiny import make_tiny_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3_5ForCausalLM

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    kind, kw = model_config(cfg)
    kw.update(over or {})
    tok = make_tiny_tokenizer(out)
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init of 8B params: fast on a GPU
            if kind == "hybrid":
                conf = th.qwen35_text_config(**{"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 3, **kw})
                model = Qwen3_5ForCausalLM(conf).to(torch.bfloat16)
            else:
                conf = LlamaConfig(**kw, bos_token_id=0, eos_token_id=2, pad_token_id=3, initializer_range=0.02)
                model = LlamaForCausalLM(conf).to(torch.bfloat16)
    finally:
        torch.set_default_dtype(old)
    model.save_pretrained(str(out))
    c = model.config
    types = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    info = {"kind": kind, "cfg": {k: v for k, v in kw.items() if not isinstance(v, dict)},
            "dense_params": sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel(),
            "attn_layers": sum(t == "full_attention" for t in types), "attn_width": c.num_attention_heads * head_dim,
            "build_s": time.perf_counter() - t0}
    del model, tok
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the children load the target on the same GPU
    return info


def write_completions(path: Path, n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[int]:
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi + 1, size=n)
    with open(path, "w") as fh:
        for i, T in enumerate(lengths):
            P = max(1, int(T * rng.uniform(0.2, 0.6)))
            ids = rng.integers(4, vocab, size=int(T)).tolist()
            fh.write(json.dumps({"id": f"b{i}", "prompt_ids": ids[:P], "completion_ids": ids[P:],
                                 "stop_reason": "length", "max_new_tokens": int(T) - P}) + "\n")
    return lengths.tolist()


def useful_flops(info: dict, lengths: list[int]) -> float:
    """2 x dense parameters x T plus the causal attention scores of the full-attention layers,
    2 x layers x (query heads x head dim) x T^2; a hybrid's Gated DeltaNet state updates (~1 % more) are not counted."""
    dense = 2 * info["dense_params"] * sum(lengths)
    attn = sum(2 * info["attn_layers"] * info["attn_width"] * T * T for T in lengths)
    return float(dense + attn)


def gemm_rate(device: str, dtype) -> float:
    """Measured dense GEMM rate (TFLOP/s): n^3 matmuls, n = 8192 on CUDA (bf16), 512 on CPU (fp32)."""
    import torch

    n = 8192 if device.startswith("cuda") else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    reps = 20 if device.startswith("cuda") else 5
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- children (own process each)
def child_loop(target: str, completions: str, layers: list[int], batch: str, device: str, dtype: str,
               parity_out: str, parity_n: int, mode: str = "loop") -> None:
    """The plain HF loop (``mode='loop'``; ``'h5loop'``: the same loop writing every sample's states, as float16, and
    its argmax to an HDF5 file, one dataset each, as a user keeps them) or the forward-only ceiling
    (``mode='forward'``); prints one JSON line
    per completions file (``completions`` and ``batch``: comma-separated, one batch size per file; the model loaded
    once; the peak GPU memory counted per file).

    ``loop``: as a user would write it: length-sorted right-padded batches, ``output_hidden_states``,
    per sample the stored layers sliced to its own length on the GPU, copied with ``non_blocking`` into
    pinned host buffers (one sync per batch), the logits' argmax likewise; nothing written. ``forward``:
    the same batches through the model alone (no hidden states kept, no copies): what the GPU can do.
    Two passes over all batches: the first (every shape's first call: CUDA warm-up, fla's Triton compile and
    autotune) is ``warmup_s``, the second ``seconds`` (the figure).
    """
    import torch
    from transformers import AutoModelForCausalLM

    dt = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dt, attn_implementation="sdpa").to(device).eval()
    for comp, b in zip(completions.split(","), batch.split(",")):
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        _loop_file(model, comp, layers, int(b), device, parity_out, parity_n, mode)


def _loop_file(model, completions: str, layers: list[int], batch: int, device: str, parity_out: str, parity_n: int,
               mode: str) -> None:
    import numpy as np
    import torch

    rows = [json.loads(line) for line in open(completions)]
    seqs = [r["prompt_ids"] + r["completion_ids"] for r in rows]
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    batches = [order[i : i + batch] for i in range(0, len(order), batch)]
    keep = set(range(parity_n))
    saved = {}
    pin = device.startswith("cuda")

    def run(b):
        L = max(len(seqs[i]) for i in b)
        ids = torch.zeros((len(b), L), dtype=torch.long)
        mask = torch.zeros((len(b), L), dtype=torch.long)
        for r, i in enumerate(b):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
            mask[r, : len(seqs[i])] = 1
        with torch.inference_mode():
            if mode == "forward":
                model(input_ids=ids.to(device, non_blocking=True), attention_mask=mask.to(device, non_blocking=True),
                      logits_to_keep=1)
                return None
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
            argmax = out.logits.argmax(-1)
            got = []
            for r, i in enumerate(b):
                T = len(seqs[i])
                st = torch.stack([out.hidden_states[k + 1][r, :T] for k in layers], dim=1)  # [T, K, H] on the GPU
                if mode == "h5loop":  # h5py has no bfloat16: a user stores float16 (same bytes), cast on the GPU
                    st = st.to(torch.float16)
                host = torch.empty(st.shape, dtype=st.dtype, pin_memory=pin)
                am = torch.empty((T,), dtype=argmax.dtype, pin_memory=pin)
                host.copy_(st, non_blocking=pin)
                am.copy_(argmax[r, :T], non_blocking=pin)
                got.append((host, am))
            sync(device)  # one sync per batch: the copies have landed
            return got

    def timed_pass(keep_states: bool) -> float:
        sync(device)
        t = time.perf_counter()
        h5 = None
        if mode == "h5loop":  # the loop a user writes to keep the states: one HDF5 dataset per sample
            import h5py

            h5 = h5py.File(f"{parity_out}.{int(keep_states)}.h5", "w")
        for b in batches:
            got = run(b)
            if h5 is not None:
                for (host, am), i in zip(got, b):
                    h5.create_dataset(f"s{i}/hidden", data=host.numpy())
                    h5.create_dataset(f"s{i}/argmax", data=am.numpy())
            if got is None or not keep_states or mode == "h5loop":
                continue
            for (host, am), i in zip(got, b):
                if i in keep:
                    saved[f"h{i}"] = host.float().numpy()
                    saved[f"a{i}"] = am.numpy()
        if h5 is not None:
            h5.close()
        sync(device)
        return time.perf_counter() - t

    # first pass over every batch, untimed in the figure: each batch's padded length is a new shape, and fla's
    # Triton kernels specialise on integer arguments and autotune per key, so a pass that meets a shape for the
    # first time compiles inside it (the stage's figure is likewise its second run, its Triton cache warm)
    warm = timed_pass(False)
    secs = timed_pass(True)
    if mode == "loop":
        np.savez(parity_out, **saved)
    for k in (0, 1):
        Path(f"{parity_out}.{k}.h5").unlink(missing_ok=True)
    print(json.dumps({"seconds": secs, "tokens": sum(len(s) for s in seqs), "warmup_s": warm,
                      "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9 if device.startswith("cuda") else None}))


def child_stage(argv: list[str]) -> None:
    """``python -m dflash_eval <argv>`` in this process; prints the peak RSS (KB) and, on CUDA, the peak GPU memory
    allocated (``torch.cuda.max_memory_allocated``, bytes) at the end."""
    import torch

    from dflash_eval.cli import main

    code = main(argv)
    print(f"PEAK_RSS_KB={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", file=sys.stderr, flush=True)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        print(f"PEAK_GPU_BYTES={torch.cuda.max_memory_allocated()}", file=sys.stderr, flush=True)
    sys.exit(code)


# --------------------------------------------------------------------------- driver
def run_child(args: list[str], env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"child {args[:2]} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def stage(target: Path, comp: Path, out: Path, layers, device, dtype, batch_tokens, env, final: bool = False) -> dict:
    """``python -m dflash_eval hidden-states`` in a child process, with the target's fingerprint record as the
    workflow passes it (the weights hashed once per target, not per job)."""
    fp = target.parent / "target_fingerprint.json"
    if not fp.exists():
        run_child(["--child-stage", "--", "target-fingerprint", "--target", str(target), "--out", str(fp)], env)
    argv = ["hidden-states", "--target", str(target), "--completions", str(comp), "--out", str(out),
            "--layer-ids", ",".join(map(str, layers)), "--device", device, "--dtype", dtype,
            "--batch-tokens", str(batch_tokens), "--final-hidden" if final else "--no-final-hidden",
            "--target-fingerprint", str(fp)]
    proc = run_child(["--child-stage", "--", *argv], env)
    m = re.search(r"computed (\d+) samples, (\d+) tokens in ([\d.]+) s", proc.stderr)
    rss = int(re.search(r"PEAK_RSS_KB=(\d+)", proc.stderr).group(1))
    batching = re.search(r"batching: (\S+)", proc.stderr).group(1)
    peak = re.search(r"peak host memory: states of (\d+) samples \((\d+) tokens\)", proc.stderr)
    total = float(re.search(r"wrote .* in ([\d.]+) s in total", proc.stderr).group(1))
    phases = re.search(r"cache writer thread: (.*)", proc.stderr)
    gpu = re.search(r"PEAK_GPU_BYTES=(\d+)", proc.stderr)
    return {"peak_gpu_gb": int(gpu.group(1)) / 1e9 if gpu else None, "tokens": int(m.group(2)), "seconds": float(m.group(3)), "rss_gb": rss / 1e6, "batching": batching,
            "held": (int(peak.group(1)), int(peak.group(2))), "total": total,
            "sdpa_fallback": "varlen flash attention unavailable" in proc.stderr,
            "writer": dict((k, float(v)) for k, v in re.findall(r"(\w+) ([\d.]+) s", phases.group(1))) if phases else {}}


def parity(cache: Path, loop_npz: Path, n: int) -> tuple[float, float]:
    import numpy as np

    from dflash_eval.cache.reader import CacheReader

    ref = np.load(loop_npz)
    worst, agree, total = 0.0, 0, 0
    with CacheReader(cache) as rd:
        for i in range(min(n, len(rd))):
            s = rd.sample(i)
            h = s.hidden.float().numpy()
            r = ref[f"h{i}"]
            for k in range(h.shape[1]):
                worst = max(worst, float(np.linalg.norm(h[:, k] - r[:, k]) / max(np.linalg.norm(r[:, k]), 1e-30)))
            agree += int((s.target_argmax.numpy() == ref[f"a{i}"]).sum())
            total += len(s.target_argmax)
    return worst, agree / max(total, 1)


def kernel_parity_timing(name: str, target: Path, comp: Path, layers: list[int], device: str, batch_tokens: int,
                         n: int, work: Path) -> dict:
    """Time the ``kernel_parity`` stage against the two extractions it stands for, in this process, warm.

    (a) :func:`dflash_eval.stages.kernel_parity.kernel_parity` on the ``n`` samples of ``comp`` (no drafters);
    (b) :func:`dflash_eval.stages.hidden_states.extract_hidden_states` of the same samples with the stage's two
    plans (:func:`dflash_eval.stages.kernel_parity.plan`: fla and torch in bf16 on CUDA with fla; on the CPU
    torch bf16 and torch float32, fla having GPU kernels only). The first ``kernel_parity`` call (the process's
    first fla use: Triton compile + autotune, CUDA warm-up) is timed apart; then each side once, warm.
    Model load is counted the same on both sides, two ways: whole calls (each call loads the target itself:
    the stage once when both plans share a dtype, each extraction once), and, when the stage shares one model,
    load excluded (the stage's own ``load_seconds`` subtracted; the extractions given a model loaded once,
    the kernel rebound between them as the stage does). The weights' sha256 is computed once beforehand
    (``target_fingerprint`` record, as the workflow passes it) and passed to every call.

    Returns:
        ``{"first_s", "kp_s", "kp_load_s", "x_s" {"a", "b"} (whole calls, seconds), "x_loaded_s" {"a", "b"} or
        None, "load_s", "plan", "ratio_whole", "ratio_no_load" (or None)}``; seconds are wall-clock (CUDA synced).
    """
    from dflash_eval.core.runtime import resolve_device, resolve_dtype
    from dflash_eval.stages.hidden_states import extract_hidden_states
    from dflash_eval.stages.kernel_parity import kernel_parity, plan
    from dflash_eval.stages.target_fingerprint import write_fingerprint
    from dflash_eval.target.hybrid import bind_linear_attention, check_bound_kernel
    from dflash_eval.target.model import load_target
    from dflash_eval.target.spec import TargetSpec

    fp = write_fingerprint(target, work / "target_fingerprint.json")
    p = plan(device, "auto", target)
    if p["a"] is None:
        raise SystemExit(f"{name}: {p['note']}")
    kw = {"n_samples": n, "batch_tokens": batch_tokens, "device": device, "dtype": "auto", "target_fingerprint": str(fp)}

    def timed(f, *args, **kwargs):
        sync(device)
        t0 = time.perf_counter()
        r = f(*args, **kwargs)
        sync(device)
        return r, time.perf_counter() - t0

    _, first = timed(kernel_parity, target, comp, layers, work / "kp_first.json", **kw)
    kp, kp_s = timed(kernel_parity, target, comp, layers, work / "kp.json", **kw)
    x_s = {}
    for k in ("a", "b"):
        out = work / f"x_{k}.h5"
        _, x_s[k] = timed(extract_hidden_states, target, comp, out, layers, batch_tokens=batch_tokens, device=device,
                          dtype=p[k]["dtype"], linear_attn_backend=p[k]["backend"], target_fingerprint=str(fp))
        out.unlink()
    res = {"first_s": first, "kp_s": kp_s, "kp_load_s": kp.get("load_seconds"), "x_s": x_s, "x_loaded_s": None,
           "load_s": None, "plan": p, "argmax_agreement": kp["argmax_agreement"], "n_tokens": kp["n_tokens"],
           "ratio_whole": kp_s / (x_s["a"] + x_s["b"]), "ratio_no_load": None}
    if kp.get("model_loads") == 1:  # one model, the kernel rebound: the stage's own path, load excluded
        dev = resolve_device(device)

        def load():
            spec = TargetSpec.read(target, fingerprint_file=fp)
            return spec, load_target(spec, device=dev, dtype=resolve_dtype(p["a"]["dtype"], dev),
                                     backend=p["a"]["backend"])
        (spec, (model, tok, _)), res["load_s"] = timed(load)
        xl = {}
        for k in ("a", "b"):
            out = work / f"xl_{k}.h5"
            binding = check_bound_kernel(model, bind_linear_attention(p[k]["backend"], dev, spec))
            _, xl[k] = timed(extract_hidden_states, target, comp, out, layers, batch_tokens=batch_tokens,
                             device=device, dtype=p[k]["dtype"], linear_attn_backend=p[k]["backend"],
                             target_fingerprint=str(fp), loaded=(model, tok, binding))
            out.unlink()
        del model, tok
        res["x_loaded_s"] = xl
        res["ratio_no_load"] = (kp_s - kp["load_seconds"]) / (xl["a"] + xl["b"])
    label = {k: f"{p[k]['backend']} {p[k]['dtype']}" for k in ("a", "b")}
    print(f"  kernel_parity plan: A = {label['a']}, B = {label['b']} ({p['note']})")
    warm = ("CUDA warm-up" if device.startswith("cuda") else "warm-up") + (
        "; the process's first fla use: Triton compile + autotune" if p["fla_available"] else "")
    print(f"  kernel_parity, first call ({warm}): {first:.2f} s, not in the figures")
    print(f"  kernel_parity (no drafters), warm: {kp_s:.2f} s whole call"
          + (f" (its one model load {kp['load_seconds']:.2f} s)" if kp.get("model_loads") == 1 else
             " (each of its two extractions loads the target)")
          + f"; {kp['n_tokens']:,} tokens, argmax agreement A vs B {kp['argmax_agreement']:.4f}")
    print(f"  extraction {label['a']} / {label['b']}, warm, whole calls (each loads the target): "
          f"{x_s['a']:.2f} s / {x_s['b']:.2f} s")
    print(f"  ratio kernel_parity / (fla + torch extraction) ({name}, {n} samples, warm): {res['ratio_whole']:.2f}x "
          "(goal <= 1.0x) [whole calls in one process, model load included on both sides: each call loads the target "
          + ("itself, the stage once, each extraction once]" if kp.get("model_loads") == 1 else
             "itself, the stage once per extraction (two dtypes), each extraction once]"))
    if res["ratio_no_load"] is not None:
        print(f"  extraction {label['a']} / {label['b']}, warm, the model loaded once ({res['load_s']:.2f} s) and the "
              f"kernel rebound: {xl['a']:.2f} s / {xl['b']:.2f} s")
        print(f"  ratio kernel_parity / (fla + torch extraction) ({name}, {n} samples, warm): "
              f"{res['ratio_no_load']:.2f}x (goal <= 1.0x) [model load excluded on both sides]")
    if not p["fla_available"]:
        print("  NOTE: fla unavailable here: the 'fla' side is torch bfloat16, the 'torch' side torch float32 "
              "(the stage's own fallback)")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny models and data, float32 on CPU (checks the script)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--models", default="smollm2-135m,llama-1.66b",
                    help=f"comma-separated subset of {list(MODELS)} (hybrid-7b,llama-8b: the user-scale pair)")
    ap.add_argument("--stage-runs", type=int, default=1,
                    help="runs of the stage per model, each its own process; with 2 the first (Triton compiling and "
                         "autotuning fla's kernels into the run's empty cache directory, as a user's first job does) "
                         "is reported apart and the second is the figure")
    ap.add_argument("--no-ceiling", action="store_true", help="leave out the forward-only ceiling")
    ap.add_argument("--out-dir", default=None, help="where targets and caches are written (default: a temp dir)")
    ap.add_argument("--batch-tokens", type=int, default=None, help="default: the config schema's cache.batch_tokens")
    ap.add_argument("--rss-samples", type=int, default=None, help="samples of the 1x RSS run (default 128; smoke 8)")
    ap.add_argument("--parity-samples", type=int, default=8)
    ap.add_argument("--no-rss", action="store_true", help="leave out the peak-RSS runs (1x and 4x --rss-samples)")
    ap.add_argument("--final-hidden", action="store_true",
                    help="the stage also stores the final normed hidden state (cache.final_hidden, for T > 0) and the "
                         "plain loop keeps it too (HF's last hidden_states entry, layer N-1): the stronger loop")
    ap.add_argument("--kernel-parity", type=int, nargs="?", const=4, default=None, metavar="N",
                    help="only time the kernel_parity stage (no drafters) on N synthetic samples (default 4) against "
                         "extracting them with each of its two kernels, in this process, warm; the bench's other "
                         "runs are skipped")
    ap.add_argument("--child-loop", nargs=9, metavar="ARG", help=argparse.SUPPRESS)
    ap.add_argument("--child-stage", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child_loop:
        t, c, layers, b, dev, dt, po, pn, mode = a.child_loop
        return child_loop(t, c, json.loads(layers), b, dev, dt, po, int(pn), mode)
    if a.child_stage:
        return child_stage(a.rest)

    import torch

    from dflash_eval.core.schema import schema_default
    from dflash_eval.core.runtime import resolve_device

    dev = str(resolve_device("cpu" if a.smoke else a.device))
    dtype = "float32" if dev == "cpu" else "bfloat16"
    batch_tokens = a.batch_tokens or (512 if a.smoke else schema_default("cache.batch_tokens"))
    rss_n = a.rss_samples or (8 if a.smoke else 128)
    table = SMOKE if a.smoke else MODELS
    root = Path(a.out_dir or tempfile.mkdtemp(prefix="dflash-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    name = torch.cuda.get_device_name(0) if dev.startswith("cuda") else "CPU"
    if a.kernel_parity is not None and a.kernel_parity < 1:
        ap.error("--kernel-parity N needs N >= 1")
    rate = gemm_rate(dev, getattr(torch, dtype)) if a.kernel_parity is None else None  # not needed for that timing
    print(f"device {dev} ({name}), {dtype}; " + (f"dense GEMM rate measured here: {rate:.3f} TFLOP/s; " if rate else "")
          + f"torch {torch.__version__}")
    print(f"outputs under {root}" + (" (smoke test: tiny models, numbers say nothing about speed)" if a.smoke else ""))
    # one Triton cache directory for the whole bench run, empty at its start (what the workflow sets per run):
    # the first process that runs fla's kernels compiles and autotunes them, the next ones read the results
    env.setdefault("TRITON_CACHE_DIR", str(root / "triton-cache"))
    for model in a.models.split(","):
        cfg, n, (lo, hi), layers, loop_batch = table[model]
        work = root / model
        info = build_target(work / "target", cfg)
        target = work / "target"
        mc = info["cfg"]
        final_id = mc["num_hidden_layers"] - 1
        loop_layers = sorted(set(layers) | {final_id}) if a.final_hidden else layers  # what the cache stores
        comp = work / "completions.jsonl"
        if a.kernel_parity is not None:
            lengths = write_completions(comp, a.kernel_parity, lo, hi, mc["vocab_size"])
            print(f"\n{model}: random init {info['kind']} (built and saved in {info['build_s']:.1f} s), "
                  f"{mc['num_hidden_layers']} layers ({info['attn_layers']} full attention), hidden {mc['hidden_size']}; "
                  f"kernel_parity timing on {a.kernel_parity} samples, {sum(lengths):,} tokens ({lo}-{hi} per sample), "
                  f"stored layers {layers}, batch_tokens {batch_tokens}")
            kernel_parity_timing(model, target, comp, layers, dev, batch_tokens, a.kernel_parity, work)
            shutil.rmtree(work, ignore_errors=True)
            continue
        lengths = write_completions(comp, n, lo, hi, mc["vocab_size"])
        flops = useful_flops(info, lengths)
        print(f"\n{model}: random init {info['kind']} ({(info['dense_params'] + mc['vocab_size'] * mc['hidden_size']) / 1e9:.2f}B "
              f"parameters, built and saved in {info['build_s']:.1f} s), {mc['num_hidden_layers']} layers "
              f"({info['attn_layers']} full attention), hidden {mc['hidden_size']}; {n} samples, "
              f"{sum(lengths):,} tokens ({lo}-{hi} per sample), stored layers {layers}"
              + (f" + the final normed state (layer {final_id}; stage and loop)" if a.final_hidden else ""))
        loop_npz = work / "loop_parity.npz"
        lp = json.loads(run_child(["--child-loop", str(target), str(comp), json.dumps(loop_layers), str(loop_batch), dev,
                                   dtype, str(loop_npz), str(a.parity_samples), "loop"], env).stdout.strip().splitlines()[-1])
        fla_note = ", the first fla use: Triton compile + autotune per shape" if info["kind"] == "hybrid" and dev != "cpu" else ""
        print(f"  plain loop's first pass (every batch once, untimed in its figure; CUDA warm-up{fla_note}): "
              f"{lp['warmup_s']:.1f} s ({lp['tokens'] / lp['warmup_s']:,.0f} tok/s); the figure is its second pass")
        fw = None
        if not a.no_ceiling:
            fw = json.loads(run_child(["--child-loop", str(target), str(comp), json.dumps(layers), str(loop_batch), dev,
                                       dtype, str(loop_npz), "0", "forward"], env).stdout.strip().splitlines()[-1])
            print(f"  forward-only first pass (untimed in its figure): {fw['warmup_s']:.1f} s "
                  f"({fw['tokens'] / fw['warmup_s']:,.0f} tok/s); the figure is its second pass")
        cache = work / "cache.h5"
        for run in range(max(1, a.stage_runs)):
            if cache.exists():
                cache.unlink()
            st = stage(target, comp, cache, layers, dev, dtype, batch_tokens, env, a.final_hidden)
            if run == 0 and a.stage_runs > 1:
                print(f"  stage, first run (its own process; the kernels' first use in it): {st['tokens'] / st['seconds']:,.0f} "
                      f"tok/s ({st['seconds']:.1f} s from its first batch; whole job {st['total']:.1f} s); not the figure")
        size = cache.stat().st_size / 1e9
        tps_s, tps_l = st["tokens"] / st["seconds"], lp["tokens"] / lp["seconds"]
        tf_s, tf_l = flops / st["seconds"] / 1e12, flops / lp["seconds"] / 1e12
        print(f"  dflash-eval hidden-states : {tps_s:12,.0f} tok/s  {tf_s:8.3f} TFLOP/s ({100 * tf_s / rate:4.1f} % of GEMM)"
              f"  [{st['batching']}, batch_tokens {batch_tokens}, {size:.2f} GB cache written; whole job "
              f"{st['total']:.1f} s incl. model load and the final fsync]")
        if st["sdpa_fallback"]:
            print("  NOTE: the stage fell back to causal SDPA per packed sample (no varlen flash attention): "
                  "one attention call per sample and layer")
        if st["writer"]:
            busy = sum(v for k, v in st["writer"].items() if k != "wait")
            print(f"  cache writer thread busy {busy:.1f} s of the stage's {st['seconds']:.1f} s "
                  f"({100 * busy / st['seconds']:.0f} %; near 100 % = the writer bounds the stage): "
                  + ", ".join(f"{k} {v:.1f} s" for k, v in st["writer"].items()))
        print(f"  plain HF loop (batch {loop_batch:3d}) : {tps_l:12,.0f} tok/s  {tf_l:8.3f} TFLOP/s "
              f"({100 * tf_l / rate:4.1f} % of GEMM)  [output_hidden_states, padded; per-sample slices, pinned non-blocking copies; nothing written]")
        print(f"  ratio dflash-eval / loop ({model}, warm): {tps_s / tps_l:.2f}x (goal >= 1.0x)")
        if fw:
            tps_f = fw["tokens"] / fw["seconds"]
            tf_f = flops / fw["seconds"] / 1e12
            print(f"  forward only (batch {loop_batch:3d}) : {tps_f:12,.0f} tok/s  {tf_f:8.3f} TFLOP/s "
                  f"({100 * tf_f / rate:4.1f} % of GEMM)  [the loop's batches, no states kept, no copies: the ceiling]")
            print(f"  ratio dflash-eval / forward-only ceiling: {tps_s / tps_f:.2f}  (goal >= 0.90)")
        worst, agree = parity(cache, loop_npz, a.parity_samples)
        print(f"  cache vs loop, first {a.parity_samples} samples: max rel-L2 of a stored layer {worst:.2e}, "
              f"argmax agreement {agree:.4f}")
        cache.unlink()
        if a.no_rss:
            shutil.rmtree(work, ignore_errors=True)
            continue
        rss = {}
        for mult in (1, 4):
            c = work / f"rss{mult}.jsonl"
            ls = write_completions(c, rss_n * mult, lo, hi, mc["vocab_size"], seed=mult)
            r = stage(target, c, work / f"rss{mult}.h5", layers, dev, dtype, batch_tokens, env)
            rss[mult] = (r, sum(ls))
            (work / f"rss{mult}.h5").unlink()
        (r1, t1), (r4, t4) = rss[1], rss[4]
        print(f"  peak RSS {rss_n} samples ({t1:,} tokens): {r1['rss_gb']:.2f} GB; {4 * rss_n} samples ({t4:,} tokens): "
              f"{r4['rss_gb']:.2f} GB (ratio {r4['rss_gb'] / r1['rss_gb']:.2f}); states held at once: "
              f"{r1['held'][1]:,} / {r4['held'][1]:,} tokens")
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
