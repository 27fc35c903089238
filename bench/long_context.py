"""Extraction and replay at long context: the stage, the plain loop and evaluate's replay at 1k, 8k and 32k tokens.

For each model (random weights from tests/tiny_hybrid.py's bench shapes, built as ``bench/extraction.py`` builds
them, with ``max_position_embeddings`` >= the longest context + 1) and each context length C, synthetic completions
of exactly C tokens (prompt C - 256, completion 256; ``--samples`` per context, default 8 / 4 / 2), one run prints:

- extraction tok/s of ``python -m dflash_eval hidden-states`` (its own process, timed from its first batch to its
  last commit; warm: one untimed stage run over every context's samples first, the same batch shapes, so fla's
  Triton kernels are compiled and autotuned into the bench's cache directory for each shape, as the second run of
  ``bench/extraction.py --stage-runs 2``), the per-token cost relative to the shortest context (goal: the longest
  within 1.5x), the stage's peak host RSS and peak GPU memory (``torch.cuda.max_memory_allocated``);
- the plain loop's tok/s on the same samples (``bench/extraction.py``'s loop: ``output_hidden_states``, padded,
  warm: its figure is its second pass over all batches) at batch ``max(1, --loop-tokens // C)``: batch 1 at 32k
  (a user cannot pad 24 x 32k tokens), and its peak GPU memory (one process for every context, the model loaded
  once);
- the replay tok/s (completion tokens per second of ``python -m dflash_eval evaluate``'s replay, as the stage
  logs it) of a random one-layer DFlash drafter (:func:`dflash_eval.drafter.demo.drafter_config_for_target`:
  the target's hidden size and heads, the stored layers as its ``target_layer_ids``) on the cache just written,
  with evaluate's peak RSS and peak GPU memory.

On one GPU (H100 80GB; ~3 min for the hybrid, built in bf16 on the GPU; ``--out-dir`` on /dev/shm when it has room):

    python3 bench/long_context.py --models hybrid-7b --out-dir /dev/shm/lc

CPU smoke test (tiny models, float32, contexts 128 / 512 / 1024): ``python bench/long_context.py --smoke``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import extraction as ex  # noqa: E402  (bench/extraction.py: target building, children, stage runs)

#: name -> (tests/tiny_hybrid.py shape or LlamaConfig kwargs, stored layers); the bench shapes of bench/extraction.py
MODELS = {name: (ex.MODELS[name][0], ex.MODELS[name][3]) for name in ("hybrid-7b", "llama-8b")}
SMOKE = {name: (ex.SMOKE[name][0], ex.SMOKE[name][3]) for name in ("hybrid-7b", "llama-8b")}


def write_context_completions(path: Path, n: int, context: int, completion: int, vocab: int, seed: int = 0) -> int:
    """``n`` synthetic completions of exactly ``context`` tokens each (the last ``completion`` the completion), ids
    drawn uniformly from ``4 .. vocab-1`` (above the tiny tokenizer's specials); returns the tokens written."""
    import numpy as np

    rng = np.random.default_rng(seed + context)
    P = context - completion
    with open(path, "w") as fh:
        for i in range(n):
            ids = rng.integers(4, vocab, size=context).tolist()
            fh.write(json.dumps({"id": f"c{context}_{i}", "prompt_ids": ids[:P], "completion_ids": ids[P:],
                                 "stop_reason": "length", "max_new_tokens": completion}) + "\n")
    return n * context


def write_drafter(target: Path, layers: list[int], out: Path, block_size: int = 16) -> Path:
    """A random-init one-layer DFlash drafter for ``target`` (:func:`~dflash_eval.drafter.demo.random_init_`), its
    ``config.json`` and bf16 ``model.safetensors`` in ``out``; mask token 1 (never in the synthetic ids)."""
    import torch
    from safetensors.torch import save_file

    from dflash_eval.drafter.demo import drafter_config_for_target, random_init_
    from dflash_eval.drafter.model import DFlashDrafter, DrafterConfig

    cfg = drafter_config_for_target(target, layers, block_size, 1, mask_token_id=1)
    torch.manual_seed(0)
    model = random_init_(DFlashDrafter(DrafterConfig.from_dict(json.loads(json.dumps(cfg)))))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()},
              str(out / "model.safetensors"))
    return out


def evaluate(drafter: Path, cache: Path, target: Path, out: Path, device: str, env: dict) -> dict:
    """``python -m dflash_eval evaluate`` in a child process (greedy, chain only; random completions are not the
    target's greedy output, so the agreement check is off); its replay seconds and tok/s as it logs them."""
    argv = ["evaluate", "--drafter", str(drafter), "--cache", str(cache), "--target", str(target), "--out", str(out),
            "--device", device, "--allow-low-agreement", "--ddtree-budgets", "",
            "--target-fingerprint", str(target.parent / "target_fingerprint.json")]
    proc = ex.run_child(["--child-stage", "--", *argv], env)
    m = re.search(r"\((\d+) verify steps, ([\d.]+) s, (\d+) tok/s", proc.stderr)
    gpu = re.search(r"PEAK_GPU_BYTES=(\d+)", proc.stderr)
    return {"steps": int(m.group(1)), "seconds": float(m.group(2)), "tps": float(m.group(3)),
            "tau": json.loads(out.read_text())["tau"],
            "rss_gb": int(re.search(r"PEAK_RSS_KB=(\d+)", proc.stderr).group(1)) / 1e6,
            "peak_gpu_gb": int(gpu.group(1)) / 1e9 if gpu else None}


def gb(x) -> str:
    return "n/a (CPU)" if x is None else f"{x:.2f} GB"


def run_model(name: str, cfg, layers: list[int], contexts: list[int], samples: list[int], completion: int,
              loop_tokens: int, dev: str, dtype: str, batch_tokens: int, root: Path, env: dict, no_loop: bool,
              loop_mode: str = "loop") -> list:
    """Every context of one model (see the module docstring); returns one dict per context."""
    work = root / name
    target = work / "target"
    info = ex.build_target(target, cfg, over={"max_position_embeddings": max(contexts) + 1})
    mc = info["cfg"]
    print(f"\n{name}: random init {info['kind']} ({(info['dense_params'] + mc['vocab_size'] * mc['hidden_size']) / 1e9:.2f}B"
          f" parameters, built and saved in {info['build_s']:.1f} s), {mc['num_hidden_layers']} layers, hidden "
          f"{mc['hidden_size']}, max_position_embeddings {mc['max_position_embeddings']}; stored layers {layers}; "
          f"contexts {contexts} x samples {samples}, completions of {completion} tokens; stage batch_tokens {batch_tokens}")
    comps = {}
    for C, n in zip(contexts, samples):
        comps[C] = work / f"ctx{C}.jsonl"
        write_context_completions(comps[C], n, C, min(completion, C // 2), mc["vocab_size"])
    union = work / "all.jsonl"  # warm-up: every context's samples in one stage run (the same batch shapes)
    union.write_text("".join(comps[C].read_text() for C in contexts))
    warm = ex.stage(target, union, work / "warm.h5", layers, dev, dtype, batch_tokens, env)
    (work / "warm.h5").unlink()
    print(f"  stage warm-up run over every context's samples (first fla use, Triton compile + autotune per shape; "
          f"not in the figures): {warm['tokens'] / warm['seconds']:,.0f} tok/s ({warm['seconds']:.1f} s)")
    drafter = write_drafter(target, layers, work / "drafter")
    loops = {}
    if not no_loop:  # one child, the model loaded once: per context its two passes and its peak GPU memory
        bs = [max(1, min(n, loop_tokens // C)) for C, n in zip(contexts, samples)]
        out = ex.run_child(["--child-loop", str(target), ",".join(str(comps[C]) for C in contexts), json.dumps(layers),
                            ",".join(map(str, bs)), dev, dtype, str(work / "loop.npz"), "0", loop_mode], env).stdout
        lines = [json.loads(x) for x in out.strip().splitlines() if x.startswith("{")]
        loops = {C: (b, lp) for C, b, lp in zip(contexts, bs, lines)}
    rows = []
    for C, n in zip(contexts, samples):
        cache = work / f"ctx{C}.h5"
        st = ex.stage(target, comps[C], cache, layers, dev, dtype, batch_tokens, env)
        row = {"context": C, "samples": n, "stage_tps": st["tokens"] / st["seconds"],
               "stage_rss_gb": st["rss_gb"], "stage_gpu_gb": st["peak_gpu_gb"], "held_tokens": st["held"][1]}
        if C in loops:
            b, lp = loops[C]
            row.update(loop_writes=loop_mode == "h5loop", loop_batch=b, loop_tps=lp["tokens"] / lp["seconds"], loop_first_s=lp["warmup_s"],
                       loop_gpu_gb=lp.get("peak_gpu_gb"))
        ev = evaluate(drafter, cache, target, work / f"eval{C}.json", dev, env)
        row.update(replay_tps=ev["tps"], replay_s=ev["seconds"], tau=ev["tau"], replay_rss_gb=ev["rss_gb"],
                   replay_gpu_gb=ev["peak_gpu_gb"])
        cache.unlink()
        rows.append(row)
        base = rows[0]
        cost = base["stage_tps"] / row["stage_tps"]
        print(f"  context {C:6,} x {row['samples']}: stage {row['stage_tps']:10,.0f} tok/s (per-token cost "
              f"{cost:.2f}x the {base['context']:,}-token one; peak RSS {row['stage_rss_gb']:.2f} GB, peak GPU "
              f"{gb(row['stage_gpu_gb'])}; states held on the host at once: {row['held_tokens']:,} tokens)")
        if C in loops:
            print(f"  context {C:6,} plain loop{' writing HDF5' if row.get('loop_writes') else ''} (batch {row['loop_batch']}, "
                  f"warm: second pass): {row['loop_tps']:10,.0f}"
                  f" tok/s (first pass {row['loop_first_s']:.1f} s; peak GPU {gb(row['loop_gpu_gb'])}); "
                  f"ratio stage / loop {row['stage_tps'] / row['loop_tps']:.2f}x")
        print(f"  context {C:6,} replay (evaluate, 1-layer random drafter): {row['replay_tps']:10,.0f} completion "
              f"tok/s ({row['replay_s']:.2f} s, per-token cost {base['replay_tps'] / row['replay_tps']:.2f}x the "
              f"{base['context']:,}-token one; peak RSS {row['replay_rss_gb']:.2f} GB, peak GPU {gb(row['replay_gpu_gb'])})")
    last = rows[-1]
    print(f"  per-token extraction cost at {last['context']:,} vs {rows[0]['context']:,} tokens ({name}): "
          f"{rows[0]['stage_tps'] / last['stage_tps']:.2f}x (goal <= 1.5x)")
    shutil.rmtree(work, ignore_errors=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny models, contexts 128,512,1024, float32 on the CPU")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--models", default="hybrid-7b", help=f"comma-separated subset of {list(MODELS)}")
    ap.add_argument("--contexts", default=None, help="tokens per sample (default 1024,8192,32768; smoke 128,512,1024)")
    ap.add_argument("--samples", default=None, help="samples per context (default 8,4,2; smoke 4,2,1)")
    ap.add_argument("--completion", type=int, default=None, help="completion tokens per sample (default 256; smoke 32)")
    ap.add_argument("--loop-tokens", type=int, default=None,
                    help="the plain loop's padded tokens per batch: batch max(1, this // context) (default 32768)")
    ap.add_argument("--no-loop", action="store_true", help="leave out the plain loop")
    ap.add_argument("--loop-writes", action="store_true", help="the plain loop also writes every sample's states (float16) "
                    "and argmax to an HDF5 file, one dataset each, as a user keeps them (the fair baseline of a "
                    "stage that writes its cache)")
    ap.add_argument("--batch-tokens", type=int, default=None, help="the stage's (default: cache.batch_tokens)")
    ap.add_argument("--out-dir", default=None, help="where targets and caches are written (default: a temp dir)")
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    a = ap.parse_args(argv)

    import torch

    from dflash_eval.core.runtime import resolve_device
    from dflash_eval.core.schema import schema_default

    contexts = [int(x) for x in (a.contexts or ("128,512,1024" if a.smoke else "1024,8192,32768")).split(",")]
    samples = [int(x) for x in (a.samples or ("4,2,1" if a.smoke else "8,4,2")).split(",")]
    if len(samples) != len(contexts) or contexts != sorted(contexts):
        ap.error("--samples needs one count per context; --contexts ascending")
    dev = str(resolve_device("cpu" if a.smoke else a.device))
    dtype = "float32" if dev == "cpu" else "bfloat16"
    root = Path(a.out_dir or tempfile.mkdtemp(prefix="dflash-long-"))
    root.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ex.REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("TRITON_CACHE_DIR", str(root / "triton-cache"))  # empty at the start: the warm-up run fills it
    name = torch.cuda.get_device_name(0) if dev.startswith("cuda") else "CPU"
    print(f"device {dev} ({name}), {dtype}; torch {torch.__version__}; outputs under {root}"
          + (" (smoke test: tiny models, numbers say nothing about speed)" if a.smoke else ""))
    table = SMOKE if a.smoke else MODELS
    out = {}
    for model in a.models.split(","):
        cfg, layers = table[model]
        out[model] = run_model(model, cfg, layers, contexts, samples, a.completion or (32 if a.smoke else 256),
                               a.loop_tokens or (1024 if a.smoke else 32768), dev, dtype,
                               a.batch_tokens or schema_default("cache.batch_tokens"), root, env, a.no_loop,
                               "h5loop" if a.loop_writes else "loop")
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
