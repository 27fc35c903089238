"""Hidden-state extraction on several GPUs: a target split over two GPUs, and two shard jobs vs one job.

Needs: torch, transformers, accelerate, safetensors, tokenizers (no network, no hub). A random-init
Llama-shaped target (bf16 safetensors + a tiny tokenizer) and a completions file of random token
ids are written to a temporary folder; then the workflow's own CLI extracts the cache, each run in a
fresh process (``python -m dflash_eval hidden-states ...``, run through ``--child`` here so the
process also reports its peak memory per GPU), in three ways:

- ``one-gpu``: the whole target on one GPU (``--devices 1``, ``CUDA_VISIBLE_DEVICES`` = the first GPU);
- ``split``: the target's layers over two GPUs (``--devices 2``; ``--max-memory`` may force a split of
  a target that fits one GPU), the path of targets larger than one GPU (dflash_eval/target/device_map.py);
- ``two-shards``: ``--shard 0/2`` and ``--shard 1/2`` (every other batch of the one-job plan,
  dflash_eval/cache/shards.py), two jobs at once, each taking its own GPU from the GPU pool
  (dflash_eval/core/gpu_pool.py), then ``merge-cache-shards``; wall time includes the merge.

It prints per run the GPUs, compute tok/s (the stage's own log line; two shards: all tokens over
the slower shard's compute time), wall seconds (process start to end, loading included), peak allocated GiB per GPU, and whether every sample's states and argmax equal
the one-GPU cache's bit for bit; then the two-shard wall time over the one-job wall time.

    python3 bench/multi_gpu.py                      # 2 GPUs; llama-3b shape, about 2-3 min on two H200
    python3 bench/multi_gpu.py --shape llama-8b --max-memory '{"0": "9GiB"}'
    .venv/bin/python bench/multi_gpu.py --smoke     # CPU, tiny target: checks this script (tests/bench/test_multi_gpu_bench.py)

With one GPU the split and two-shard runs are skipped (said so in the output). On CPU (``--smoke``)
the split run loads the target on the CPU as one device and the shard jobs take fake pool devices:
the figures are not GPU figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

# (hidden, intermediate, layers, heads, kv heads)
SHAPES = {
    "llama-3b": (3072, 8192, 28, 24, 8),
    "llama-8b": (4096, 14336, 32, 32, 8),
}
VOCAB = 49152
COMPUTED = re.compile(r"computed (\d+) samples, (\d+) tokens in ([\d.]+) s: (\d+) tok/s")


def child(out_json: str, argv: list[str]) -> int:
    """Run one CLI stage in this process, then write its peak memory per visible GPU to ``out_json``."""
    import torch

    from dflash_eval import cli

    t0 = time.perf_counter()
    code = cli.main(argv)
    peaks = {}
    if torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        names = [d for d in visible.split(",") if d] or [str(i) for i in range(torch.cuda.device_count())]
        peaks = {names[i]: torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())}
    Path(out_json).write_text(json.dumps({"code": code, "seconds": time.perf_counter() - t0, "peak_bytes": peaks,
                                          "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}))
    return code


def build_target(root: Path, shape: str, smoke: bool) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiny import make_tiny_target, make_tiny_tokenizer

    target = root / "target"
    if smoke:
        return make_tiny_target(target, num_layers=4, hidden=64)
    hidden, inter, layers, heads, kv = SHAPES[shape]
    make_tiny_tokenizer(target)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=8192,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(target))
    n = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    print(f"random target {shape}: {n / 1e9:.2f}B parameters ({2 * n / 2**30:.1f} GiB bf16)", flush=True)
    return target


def write_completions(path: Path, n: int, length: int, vocab: int, seed: int = 0) -> list[dict]:
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        T = int(rng.integers(length // 2, length + 1))
        P = max(1, T // 3)
        ids = rng.integers(4, vocab, size=T).tolist()
        rows.append({"id": f"s{i}", "prompt_ids": ids[:P], "completion_ids": ids[P:], "stop_reason": "length",
                     "max_new_tokens": T - P})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _start(root: Path, name: str, target: Path, completions: Path, layers: str, flags: list[str], env: dict):
    out_json = root / f"{name}.json"
    argv = ["hidden-states", "--target", str(target), "--completions", str(completions), "--layer-ids", layers,
            "--out", str(root / f"{name}.h5"), *flags]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(out_json), *argv]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(REPO), **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return proc, out_json


def _finish(proc, out_json: Path) -> dict:
    log, _ = proc.communicate()
    if proc.returncode != 0:
        sys.stdout.write(log)
        raise SystemExit(f"child failed ({proc.returncode})")
    res = json.loads(out_json.read_text())
    m = COMPUTED.search(log)
    res["tokens"], res["compute_s"], res["tok_s"] = (int(m.group(2)), float(m.group(3)), int(m.group(4))) if m \
        else (0, 0.0, 0)
    res["placement"] = [line.split("dflash_eval.target.device_map: ")[1] for line in log.splitlines()
                        if "dflash_eval.target.device_map: " in line]
    return res


def states(cache: Path) -> dict:
    """sample id -> (hidden, argmax) of a cache."""
    from dflash_eval.cache.reader import CacheReader

    with CacheReader(cache) as rd:
        return {s.sample_id: (s.hidden, s.target_argmax) for s in (rd.sample(i) for i in range(len(rd)))}


def compare(ref: dict, cache: Path) -> dict:
    """Against the one-GPU states: bit-identical (states and argmax of every sample), largest abs difference
    of any state, and the share of positions whose argmax agrees."""
    import torch

    got = states(cache)
    if set(got) != set(ref):
        return {"identical": False, "max_abs": float("inf"), "argmax_agree": 0.0}
    same = all(torch.equal(ref[k][0], got[k][0]) and torch.equal(ref[k][1], got[k][1]) for k in ref)
    diff = max(float((ref[k][0].float() - got[k][0].float()).abs().max()) for k in ref)
    agree = sum(int((ref[k][1] == got[k][1]).sum()) for k in ref) / sum(len(ref[k][1]) for k in ref)
    return {"identical": same, "max_abs": diff, "argmax_agree": agree}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2], sys.argv[3:]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny target: check the script, not the GPUs")
    ap.add_argument("--shape", choices=list(SHAPES), default="llama-3b")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--length", type=int, default=1024, help="longest sample in tokens (shortest: half)")
    ap.add_argument("--layer-ids", default="1,8,15,22,26")
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--max-memory", default=None, help='split run: target.max_memory as JSON, e.g. {"0": "4GiB"}')
    ap.add_argument("--out-dir", default=None, help="keep the target and caches here")
    args = ap.parse_args()
    import torch

    from dflash_eval.cache.shards import merge_shards

    gpus = [] if args.smoke else [str(i) for i in range(torch.cuda.device_count())]
    if not args.smoke and not gpus:
        raise SystemExit("no GPU visible: use --smoke on CPU")
    samples, length, layers = (8, 24, "0,2,3") if args.smoke else (args.samples, args.length, args.layer_ids)
    root = Path(args.out_dir or tempfile.mkdtemp(prefix="multi-gpu-"))
    root.mkdir(parents=True, exist_ok=True)
    target = build_target(root, args.shape, args.smoke)
    write_completions(root / "all.jsonl", samples, length, 380 if args.smoke else VOCAB)
    common = ["--batch-tokens", str(args.batch_tokens if not args.smoke else 64)]
    device = ["--device", "cpu"] if args.smoke else []
    pool = {"DFLASH_EVAL_GPU_POOL": str(root / "pool"),
            "DFLASH_EVAL_GPU_POOL_DEVICES": "0,1" if args.smoke else ",".join(gpus)}
    one_env = {"CUDA_VISIBLE_DEVICES": gpus[0]} if gpus else {}
    results = {}
    t0 = time.perf_counter()
    results["one-gpu"] = _finish(*_start(root, "one", target, root / "all.jsonl", layers,
                                         [*common, *device, "--devices", "1"], one_env))
    results["one-gpu"]["wall_s"] = time.perf_counter() - t0
    ref = states(root / "one.h5")
    report = {"one-gpu": {"identical": True, "max_abs": 0.0, "argmax_agree": 1.0}}
    if args.smoke or len(gpus) >= 2:
        flags = [*common, *device, "--devices", "2"] + (["--max-memory", args.max_memory] if args.max_memory else [])
        t0 = time.perf_counter()
        results["split"] = _finish(*_start(root, "split", target, root / "all.jsonl", layers, flags,
                                           {"CUDA_VISIBLE_DEVICES": ",".join(gpus[:2])} if gpus else {}))
        results["split"]["wall_s"] = time.perf_counter() - t0
        report["split"] = compare(ref, root / "split.h5")
        t0 = time.perf_counter()
        procs = [_start(root, f"shard{k}", target, root / "all.jsonl", layers,
                        [*common, "--devices", "1", "--shard", f"{k}/2"], pool) for k in (0, 1)]
        shards = [_finish(*p) for p in procs]
        merge_shards([root / "shard0.h5", root / "shard1.h5"], root / "all.jsonl", root / "two.h5")
        wall = time.perf_counter() - t0
        results["two-shards"] = {"wall_s": wall, "tokens": sum(s["tokens"] for s in shards),
                                 "compute_s": max(s["compute_s"] for s in shards),
                                 "tok_s": int(sum(s["tokens"] for s in shards) / max(max(s["compute_s"] for s in shards),
                                                                                      1e-9)),
                                 "peak_bytes": {k: v for s in shards for k, v in s["peak_bytes"].items()},
                                 "cuda_visible_devices": "|".join(str(s["cuda_visible_devices"]) for s in shards),
                                 "placement": []}
        report["two-shards"] = compare(ref, root / "two.h5")
    else:
        print("1 GPU visible: split and two-shard runs skipped (they need 2)")
    dev = "cpu (smoke: not GPU figures)" if args.smoke else torch.cuda.get_device_name(0)
    print(f"\n{dev}; {samples} samples, {results['one-gpu']['tokens']} tokens, layers {layers}")
    print(f"{'run':>11} {'GPUs':>9} {'tok/s':>9} {'wall s':>7}  {'peak GiB per GPU':<28} vs one-gpu")
    for name, r in results.items():
        peak = ", ".join(f"{k}: {v / 2**30:.2f}" for k, v in r["peak_bytes"].items()) or "-"
        c = report[name]
        print(f"{name:>11} {str(r['cuda_visible_devices']):>9} {r['tok_s']:>9} {r['wall_s']:>7.1f}  {peak:<28} "
              f"{'bit-identical' if c['identical'] else 'differs'} (max abs {c['max_abs']:.3g}, argmax agree "
              f"{c['argmax_agree']:.4f})")
        for line in r["placement"]:
            print(f"{'':>11} placement: {line}")
    if "two-shards" in results:
        print(f"two-shard wall / one-job wall: {results['two-shards']['wall_s'] / results['one-gpu']['wall_s']:.2f}")
    print(json.dumps({"results": results, "identical": report}, default=str))


if __name__ == "__main__":
    main()
