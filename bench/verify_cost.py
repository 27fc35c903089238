"""What verified cache reads cost, against the evaluate stage's own time on the same samples.

``CacheReader.sample`` checks every sample it returns (:func:`dflash_eval.cache.sample_check.check_read_sample`:
sha256 over the stored bytes, and a scan for non-finite hidden states). This bench writes a synthetic
cache (random bf16 states, the real writer), then times on it:

- ``read_s``: every sample read with ``CacheReader(verify=False)`` (HDF5 read + conversion);
- ``check_s``: the reader's checks alone, on the same arrays, as the reader runs them
  (:func:`dflash_eval.cache.sample_check.checksum_and_scan`: sha256 and the finite scan in one pass), beside
  the two separate passes they replaced (``hash_s`` + ``finite_s`` = ``verify_s``);
- ``evaluate_s`` / ``evaluate_unverified_s``: evaluate's replay loop as the stage runs it (longest
  first, memory-sized groups, ``CacheReader.verified_samples``: the checks in threads while the next
  samples are read and while the group is replayed, its errors raised when the group is done,
  :func:`dflash_eval.replay.ddtree.replay_with_trees` for evaluate's default DDTree budgets) with
  a random drafter of the chosen size on the chosen device, with and without verification (after
  one untimed warm-up pass; ``--rounds`` rounds, unverified and verified interleaved, the minimum of
  each: the timing noise of a shared host is one-sided);

- ``tensor_read_s`` / ``tensor_check_s`` / ``tensor_check_plain_s``: the target's embedding and LM head
  (untied, bf16, ``--tensors``: the bench shape's or a Qwen3.6-27B-sized pair, 2 x 2.5 GB), read from a
  safetensors file as every drafter stage does (page cache warm), and their fingerprint check
  (:func:`dflash_eval.target.spec.tensor_sha256`: 64 MiB chunks in the job's torch threads) beside the
  one-stream sha256 it replaced; once per evaluate job, so ``tensor_check_pct_of_evaluate`` relates it
  to this run's evaluate time for ``n_samples`` samples (``tensor_check_pct_at_1000``: at 1,000 samples);

and prints one JSON line with ``verify_pct_of_evaluate`` (``check_s``, the checks' own time as if
run one after the other, over ``evaluate_s``) and ``overhead_pct`` (the wall time verification adds to
evaluate's loop; ``within_goal``: at most 5 %).

Default shape: a Qwen3-8B-sized target layout (hidden 4096, vocab 151936, 36 layers, GQA 32/8 heads,
head_dim 128: Qwen/Qwen3-8B ``config.json``), 5 stored layers, a 5-layer drafter, block size 16,
64 samples of 512-2048 tokens. ``--smoke``: a tiny shape on the CPU in a few seconds (run by
``tests/cache/test_reliability.py``).

H200 host: ``python3 bench/verify_cost.py --out-dir /tmp/dflash-verify`` (writes a ~3.5 GB cache and a
2.5 GB embedding/head file; ``--tensors qwen3.6-27b``: 5.1 GB).
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

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dflash_eval.replay.anchors import context_bytes_per_token, length_groups  # noqa: E402
from dflash_eval.cache.format import FORMAT_VERSION, sample_sha256  # noqa: E402
from dflash_eval.cache.reader import CacheReader  # noqa: E402
from dflash_eval.cache.writer import write_cache  # noqa: E402
from dflash_eval.replay.ddtree import replay_with_trees  # noqa: E402
from dflash_eval.drafter.model import DFlashDrafter  # noqa: E402
from dflash_eval.drafter.config import DrafterConfig  # noqa: E402
from dflash_eval.core.runtime import free_memory_bytes, resolve_device  # noqa: E402
from dflash_eval.cache.sample_check import checksum_and_scan, first_non_finite  # noqa: E402
from dflash_eval.target.spec import tensor_sha256, tensor_sha256_plain  # noqa: E402

#: name -> target layout (hidden, intermediate, heads, kv heads, head_dim, layers, vocab), stored layers,
#: drafter layers, block size, samples, (min, max) tokens, DDTree budgets
SHAPES = {
    "qwen3-8b": ((4096, 12288, 32, 8, 128, 36, 151936), [1, 9, 17, 25, 33], 5, 16, 64, (512, 2048),
                 [8, 16, 32, 64, 128, 256]),
    "smoke": ((64, 128, 4, 2, 16, 6, 512), [1, 4], 1, 4, 6, (24, 48), [4, 8]),
}


def drafter_config(layout, layer_ids, n_layers: int, block: int) -> dict:
    h, inter, heads, kv, hd, n_target, vocab = layout
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": h, "intermediate_size": inter,
            "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "num_hidden_layers": n_layers,
            "num_target_layers": n_target, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 40960,
            "vocab_size": vocab, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
            "block_size": block, "dflash_config": {"target_layer_ids": layer_ids, "mask_token_id": vocab - 1,
                                                   "block_size": block}}


def make_cache(path: Path, layout, layer_ids, n: int, lo: int, hi: int) -> None:
    h, vocab = layout[0], layout[6]
    rng = np.random.default_rng(0)
    attrs = {"format": "dflash-eval/hidden-state-cache", "format_version": FORMAT_VERSION, "target_layer_ids": layer_ids,
             "hidden_size": h, "num_target_layers": layout[5]}

    def samples():
        for i in range(n):
            T = int(rng.integers(lo, hi + 1))
            P = T // 4
            ids = rng.integers(0, vocab - 1, size=T)
            hidden = torch.from_numpy(rng.standard_normal((T, len(layer_ids), h), dtype=np.float32)).to(torch.bfloat16)
            yield {"sample_id": f"s{i}", "input_ids": ids.tolist(), "prompt_len": P, "hidden": hidden,
                   "target_argmax": np.roll(ids, -1), "stop_reason": "length", "max_new_tokens": T - P}

    write_cache(path, attrs, samples())


#: (vocab, hidden) of the target's embedding and LM head: Qwen/Qwen3-8B and Qwen3.6-27B ``config.json``
TENSOR_SHAPES = {"smoke": (512, 64), "qwen3-8b": (151936, 4096), "qwen3.6-27b": (248320, 5120)}


def tensor_check_cost(out_dir: Path, vocab: int, hidden: int, dev=None) -> dict:
    """Seconds to read an untied bf16 embedding + LM head from safetensors and bring them to ``dev`` (warm page
    cache; ``safe_open`` maps the file, so the copy is what reads the bytes), as the stages read them, and to
    check them: :func:`tensor_sha256` (the stages') and :func:`tensor_sha256_plain` (before)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    f = out_dir / f"embed_head_{vocab}x{hidden}.safetensors"
    if not f.exists():
        g = torch.Generator().manual_seed(1)
        save_file({k: torch.randn(vocab, hidden, generator=g).to(torch.bfloat16)
                   for k in ("model.embed_tokens.weight", "lm_head.weight")}, str(f))

    def read():
        with safe_open(str(f), framework="pt") as fh:
            return [fh.get_tensor(k) for k in ("model.embed_tokens.weight", "lm_head.weight")]

    dev = dev or torch.device("cpu")
    for x in read():  # warm the page cache
        x.to(dev, copy=True)
    sync(dev)
    t0 = time.perf_counter()
    tensors = read()
    on_dev = [x.to(dev, copy=True) for x in tensors]
    sync(dev)
    read_s = time.perf_counter() - t0
    del on_dev
    t0 = time.perf_counter()
    for x in tensors:
        tensor_sha256(x)
    check_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for x in tensors:
        tensor_sha256_plain(x)
    plain_s = time.perf_counter() - t0
    nbytes = sum(x.numel() * x.element_size() for x in tensors)
    return {"tensor_gb": round(nbytes / 1e9, 3), "tensor_read_s": read_s, "tensor_check_s": check_s,
            "tensor_check_plain_s": plain_s, "tensor_check_speedup": plain_s / check_s,
            "_file": f}


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU (seconds)")
    ap.add_argument("--device", default="auto", help="auto: cuda when available")
    ap.add_argument("--samples", type=int, default=0, help="samples in the synthetic cache (0: the shape's)")
    ap.add_argument("--out-dir", default=None, help="where the cache is written (default: a temp folder)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds of evaluate's loop, unverified and verified "
                    "interleaved; the minimum of each is reported")
    ap.add_argument("--tensors", choices=sorted(TENSOR_SHAPES), default=None,
                    help="embedding / LM head size of the fingerprint check (default: the bench shape's)")
    args = ap.parse_args(argv)
    shape = "smoke" if args.smoke else "qwen3-8b"
    layout, layer_ids, n_layers, block, n, (lo, hi), budgets = SHAPES[shape]
    n = args.samples or n
    dev = torch.device("cpu") if args.smoke else resolve_device(args.device)
    dt = torch.float32 if dev.type == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    cfg = DrafterConfig.from_dict(drafter_config(layout, layer_ids, n_layers, block))
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.ndim == 2:
                p.normal_(std=0.02)
    drafter = drafter.to(device=dev, dtype=dt).eval()
    embed = (torch.randn(layout[6], layout[0]) * 0.02).to(device=dev, dtype=dt)
    head = (torch.randn(layout[6], layout[0]) * 0.02).to(device=dev, dtype=dt)
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="dflash-verify-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = out_dir / f"verify_cost_{shape}_{n}.h5"
    t0 = time.perf_counter()
    if not cache.exists():
        make_cache(cache, layout, layer_ids, n, lo, hi)
    write_s = time.perf_counter() - t0

    with CacheReader(cache, verify=False) as rd:  # warm the page cache, then time plain reads
        for i in range(len(rd)):
            rd.sample(i)
        t0 = time.perf_counter()
        for i in range(len(rd)):
            rd.sample(i, layer_ids)
        read_s = time.perf_counter() - t0
        hash_s = finite_s = check_s = 0.0
        nbytes = 0
        for i in range(len(rd)):
            g = rd._f[f"samples/{i:06d}"]
            ids, argmax, hidden = g["input_ids"][()], g["target_argmax"][()], g["hidden"][()]
            meta = g.attrs.get("meta")
            nbytes += ids.nbytes + argmax.nbytes + hidden.nbytes
            t1 = time.perf_counter()
            sample_sha256(ids, argmax, hidden, meta)
            t2 = time.perf_counter()
            first_non_finite(hidden)
            t3 = time.perf_counter()
            checksum_and_scan(ids, argmax, hidden, meta)
            check_s += time.perf_counter() - t3
            finite_s += t3 - t2
            hash_s += t2 - t1

    def evaluate_loop(verify: bool) -> tuple[float, list[int]]:
        """evaluate's replay loop (stages/evaluate.py ``_replay_all``): longest first, memory-sized groups."""
        with CacheReader(cache, verify=verify) as rd:
            lengths = [rd.length(i) for i in range(len(rd))]
            order = sorted(range(len(rd)), key=lambda i: -lengths[i])
            mem = free_memory_bytes(dev)
            read_tokens = max(1, mem // 4 // context_bytes_per_token(cfg, torch.finfo(dt).bits // 8))
            sync(dev)
            t0 = time.perf_counter()
            for group in length_groups([lengths[i] for i in order], read_tokens, 0):
                with rd.verified_samples([order[g] for g in group], cfg.target_layer_ids) as samples:
                    replay_with_trees(drafter, embed, head, samples, budgets, block, mem, 0)
            sync(dev)
            return time.perf_counter() - t0, lengths

    evaluate_loop(False)  # warm-up (kernels, allocator)
    plain, verified = [], []
    for _ in range(max(1, args.rounds)):
        s, lengths = evaluate_loop(False)
        plain.append(s)
        verified.append(evaluate_loop(True)[0])
    plain_s, evaluate_s = min(plain), min(verified)
    verify_s = hash_s + finite_s
    result = {"shape": shape, "device": str(dev), "torch_threads": torch.get_num_threads(), "n_samples": n,
              "tokens": sum(lengths), "stored_mb": round(nbytes / 1e6, 1), "write_s": round(write_s, 3),
              "read_s": read_s, "hash_s": hash_s, "finite_s": finite_s, "verify_s": verify_s,
              "check_s": check_s, "rounds_unverified_s": plain, "rounds_verified_s": verified,
              "hash_gb_per_s": round(nbytes / 1e9 / max(hash_s, 1e-9), 3), "evaluate_unverified_s": plain_s,
              "evaluate_s": evaluate_s, "verify_pct_of_evaluate": 100 * check_s / evaluate_s,
              "overhead_pct": 100 * (evaluate_s - plain_s) / plain_s, "goal_pct": 5.0}
    result["within_goal"] = result["overhead_pct"] <= result["goal_pct"]
    vocab, hidden = TENSOR_SHAPES[args.tensors or shape]
    tensors = tensor_check_cost(out_dir, vocab, hidden, dev)
    tensor_file = tensors.pop("_file")
    per_sample = evaluate_s / n
    result.update(tensors, tensor_shape=[vocab, hidden], evaluate_s_per_sample=per_sample,
                  tensor_check_pct_of_evaluate=100 * tensors["tensor_check_s"] / evaluate_s,
                  tensor_check_plain_pct_of_evaluate=100 * tensors["tensor_check_plain_s"] / evaluate_s,
                  tensor_check_pct_at_1000=100 * tensors["tensor_check_s"] / (1000 * per_sample))
    if not args.out_dir:
        cache.unlink()
        tensor_file.unlink()
        os.rmdir(out_dir)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
