"""The cache's information on the target's p at T > 0: the final normed hidden state vs top-K logits.

Offline acceptance at temperature > 0 needs the target's filtered distribution at every position of the
cached trajectory. Two ways to keep it, measured here on the hidden_states stage's own forward
(:func:`dflash_eval.cache.extract.forward_batch`, the stage's length batches of ``cache.batch_tokens``, packed
where the stage packs), for a random-init target built from a transformers config (no hub, no GGUF;
the models of ``bench/extraction.py``, stored layers = DFlash's ``build_target_layer_ids`` for 5 draft
layers, so the last layer is not among them):

- **final hidden**: the target's final-normed last hidden state ``[T, H]`` (what the stage already
  computes for its argmax). The shared LM head gives the exact logits, so p is exact for every
  (temperature, top-p, top-k). Extra: H values per token; the LM head runs again at evaluate time.
- **top-K logits**: the K largest logits and their ids per position, in place of the argmax. p is exact
  for settings with ``0 < top_k <= K`` (the reference's top-k keeps exactly those; checked below), not
  for ``top_k = 0`` (the mass outside the top K is unknown at any other temperature).

Printed per model: tok/s of the stage's forward (outputs copied to the host) without and with each
option, and the plain HF loop a user would write (``output_hidden_states=True``, padded batches) for
scale; bytes per token of each option, computed and measured from HDF5 files written like the cache's
per-sample datasets (``--write-samples`` samples, with the write rate); the evaluate-side cost of p for
``T = 1, top-p 0.95, top-k 20`` (the target's probability of each cached token, what the estimator given
the trajectory needs) from each; the exactness checks (from the final hidden state vs the HF model's own
logits; from the top-K logits vs from the full logits).

Timing: variants alternate batch by batch (one warm-up batch first) so drift hits all alike, and the
fastest of ``--repeats`` passes counts; top-K is
timed as the stage forward plus the difference between ``topk`` and ``argmax`` over the same LM-head
chunks (with the copy to the host), which is its cost where it replaces the argmax.

CPU smoke test (tiny model, float32; checks the script, not speed): ``.venv/bin/python bench/sampling_cache.py --smoke``
On one H200, from the repository root (no network; ~2 GB under ``--out-dir``):

    python3 bench/sampling_cache.py --out-dir /tmp/dflash-bench
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))

from extraction import MODELS as EXTRACTION_MODELS, SMOKE as EXTRACTION_SMOKE, build_target, sync, write_completions  # noqa: E402

#: name -> (config, samples, (min, max) tokens, stored layers, plain-loop batch)
MODELS = {"llama-1.66b": (*EXTRACTION_MODELS["llama-1.66b"][:3], [1, 6, 11, 16, 21], 32)}
SMOKE = {"llama-1.66b": (*EXTRACTION_SMOKE["llama-1.66b"][:3], [1, 2], 4)}
TOPKS = (20, 64)
SETTING = (1.0, 0.95, 20)  # temperature, top-p, top-k: the DFlash 2 model card's headline setting


def _head_chunks(head, last, chunk: int, fn):
    for t0 in range(0, last.shape[0], chunk):
        fn(head(last[t0 : t0 + chunk]))


def time_batches(model, seqs, batches, layers, dev, pad_id, packed, topks):
    """Seconds over ``batches`` per variant: ``stage`` (the stage's forward, outputs to the host), ``final``
    (+ the final normed hidden state), ``top<K>`` (the stage + top-K logits in place of the argmax)."""
    import torch

    from dflash_eval.cache.extract import forward_batch

    n_layers = model.config.num_hidden_layers
    head = model.get_output_embeddings()
    chunk = max(1, (1 << 30) // (head.weight.shape[0] * head.weight.element_size()))  # as forward_batch
    secs = {"stage": 0.0, "final": 0.0, **{f"top{k}": 0.0 for k in topks}}

    def timed(fn):
        sync(str(dev))
        t = time.perf_counter()
        out = fn()
        sync(str(dev))
        return time.perf_counter() - t, out

    def with_final(bs):
        h, a = forward_batch(model, bs, layers + [n_layers - 1], dev, pad_id, packed)
        a.cpu(), h.cpu()
        return h

    with torch.inference_mode():
        for i, b in enumerate([batches[-1]] + batches):  # the first run is the warm-up
            bs = [seqs[j] for j in b]
            if i % 2:  # which variant runs first alternates too
                t_stage, _ = timed(lambda: [x.cpu() for x in forward_batch(model, bs, layers, dev, pad_id, packed)])
                t_final, h = timed(lambda: with_final(bs))
            else:
                t_final, h = timed(lambda: with_final(bs))
                t_stage, _ = timed(lambda: [x.cpu() for x in forward_batch(model, bs, layers, dev, pad_id, packed)])
            last = h[:, -1]
            t_arg, _ = timed(lambda: _head_chunks(head, last, chunk, lambda lg: lg.argmax(-1).cpu()))
            extra = {k: timed(lambda: _head_chunks(head, last, chunk,
                                                   lambda lg: [x.cpu() for x in torch.topk(lg, k, dim=-1)]))[0]
                     for k in topks}
            if i:
                secs["stage"] += t_stage
                secs["final"] += t_final
                for k in topks:
                    secs[f"top{k}"] += t_stage + extra[k] - t_arg
    return secs


def plain_loop(model, seqs, layers, batch, dev):
    """The plain HF loop of ``bench/extraction.py``: padded batches, output_hidden_states, states + argmax to host."""
    import torch

    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    batches = [order[i : i + batch] for i in range(0, len(order), batch)]

    def run(b):
        L = max(len(seqs[i]) for i in b)
        ids = torch.zeros((len(b), L), dtype=torch.long)
        mask = torch.zeros((len(b), L), dtype=torch.long)
        for r, i in enumerate(b):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
            mask[r, : len(seqs[i])] = 1
        with torch.inference_mode():
            out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), output_hidden_states=True)
            torch.stack([out.hidden_states[i + 1] for i in layers], dim=2).cpu()
            out.logits.argmax(-1).cpu()

    run(batches[-1])
    sync(str(dev))
    t = time.perf_counter()
    for b in batches:
        run(b)
    sync(str(dev))
    return time.perf_counter() - t


def write_files(root: Path, model, seqs, layers, dev, pad_id, packed, topks) -> dict:
    """Write each option's per-sample datasets for ``seqs`` as the cache stores them; bytes, tokens, seconds."""
    import h5py
    import numpy as np
    import torch

    from dflash_eval.cache.format import to_storage
    from dflash_eval.cache.extract import forward_batch

    n_layers = model.config.num_hidden_layers
    head = model.get_output_embeddings()
    with torch.inference_mode():
        h, argmax = forward_batch(model, seqs, layers + [n_layers - 1], dev, pad_id, packed)
        logits = head(h[:, -1])
        tops = {k: torch.topk(logits, k, dim=-1) for k in topks}
    off = np.concatenate([[0], np.cumsum([len(s) for s in seqs])])
    parts = {"stage": lambda r: {"input_ids": np.asarray(seqs[r], dtype=np.int32),
                                 "target_argmax": argmax[off[r] : off[r + 1]].cpu().numpy(),
                                 "hidden": to_storage(h[off[r] : off[r + 1], :-1])[0]},
             "final": lambda r: {"final_hidden": to_storage(h[off[r] : off[r + 1], -1])[0]}}
    for k in topks:
        parts[f"top{k}"] = lambda r, k=k: {"topk_logits": to_storage(tops[k].values[off[r] : off[r + 1]])[0],
                                           "topk_ids": tops[k].indices[off[r] : off[r + 1]].int().cpu().numpy()}
    out = {}
    for name, fn in parts.items():
        path = root / f"{name}.h5"
        t = time.perf_counter()
        with h5py.File(path, "w") as f:
            for r in range(len(seqs)):
                g = f.create_group(f"samples/{r:06d}")
                for key, arr in fn(r).items():
                    g.create_dataset(key, data=arr)
            f.flush()
        out[name] = {"bytes": path.stat().st_size, "seconds": time.perf_counter() - t}
        path.unlink()
    out["tokens"] = int(off[-1])
    return out


def evaluate_side(model, seqs, layers, dev, pad_id, packed, topks) -> dict:
    """Cost per token of p(x_m | x_<m) at SETTING (what evaluate needs) from each option, and exactness checks."""
    import torch

    from dflash_eval.cache.extract import forward_batch
    from dflash_eval.replay.sampling import filtered_probs, token_probs

    T, top_p, top_k = SETTING
    n_layers = model.config.num_hidden_layers
    head = model.get_output_embeddings()
    res = {}
    with torch.inference_mode():
        h, _ = forward_batch(model, seqs, layers + [n_layers - 1], dev, pad_id, packed)
        ids = torch.tensor([t for s in seqs for t in s[1:] + [0]], device=dev)  # token after each position
        last = h[:, -1]
        full = head(last)
        sync(str(dev))
        t = time.perf_counter()
        p_final = token_probs(head(last), ids, T, top_p, top_k)
        sync(str(dev))
        res["final_s"] = time.perf_counter() - t
        for k in topks:
            vals, top_ids = torch.topk(full, k, dim=-1)
            sync(str(dev))
            t = time.perf_counter()
            p_top = torch.where(top_ids == ids[:, None], filtered_probs(vals, T, top_p, top_k), 0.0).sum(-1)
            sync(str(dev))
            res[f"top{k}_s"] = time.perf_counter() - t
            res[f"top{k}_exact"] = bool(torch.equal(p_top, p_final)) if k >= top_k else None
            # without a top-k filter (T = 1, top-p 0.95): the filtered mass the stored top K miss
            p_free = filtered_probs(full, T, top_p, 0)
            res[f"top{k}_missing"] = float((1 - p_free.gather(-1, top_ids).sum(-1)).clamp_min(0).mean())
        # p from the final hidden state vs the HF model's own logits, one sample at a time
        worst, off = 0.0, 0
        for s in seqs[:4]:
            lg = model(input_ids=torch.tensor([s], device=dev)).logits[0]
            ref = token_probs(lg, ids[off : off + len(s)], T, top_p, top_k)
            worst = max(worst, float((ref - p_final[off : off + len(s)]).abs().max()))
            off += len(s)
        res["final_vs_hf"] = worst
    res["tokens"] = len(last)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model and data, float32 on CPU (checks the script)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out-dir", default=None, help="targets and the HDF5 files (default: a temp dir)")
    ap.add_argument("--batch-tokens", type=int, default=None, help="default: the config schema's cache.batch_tokens")
    ap.add_argument("--write-samples", type=int, default=None, help="samples written per option (default 64; smoke 8)")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes over all batches; the fastest counts")
    a = ap.parse_args()

    import torch

    from dflash_eval.core.schema import schema_default
    from dflash_eval.cache.extract import packing_support
    from dflash_eval.core.runtime import length_batches, resolve_device
    from dflash_eval.target.model import load_target
    from dflash_eval.target.spec import TargetSpec

    dev = resolve_device("cpu" if a.smoke else a.device)
    dtype = "float32" if dev.type == "cpu" else "bfloat16"
    batch_tokens = a.batch_tokens or (512 if a.smoke else schema_default("cache.batch_tokens"))
    n_write = a.write_samples or (8 if a.smoke else 64)
    root = Path(a.out_dir or tempfile.mkdtemp(prefix="dflash-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(0) if dev.type == "cuda" else "CPU"
    print(f"device {dev} ({name}), {dtype}, torch {torch.__version__}; batch_tokens {batch_tokens}; "
          f"outputs under {root}"
          + (" (smoke test: tiny model, numbers say nothing about speed)" if a.smoke else ""))
    for model_name, (cfg, n, (lo, hi), layers, loop_batch) in (SMOKE if a.smoke else MODELS).items():
        work = root / model_name
        build_target(work / "target", cfg)
        target = work / "target"
        comp = work / "completions.jsonl"
        write_completions(comp, n, lo, hi, cfg["vocab_size"])
        rows = [json.loads(line) for line in open(comp)]
        seqs = [r["prompt_ids"] + r["completion_ids"] for r in rows]
        spec = TargetSpec.read(target)
        packed = packing_support(spec)[0]
        model, tok, _ = load_target(spec, device=dev, dtype=dtype)
        pad_id = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0
        batches = length_batches([len(s) for s in seqs], max_tokens=batch_tokens, packed=packed)
        tokens = sum(len(s) for s in seqs)
        H, e = cfg["hidden_size"], torch.finfo(getattr(torch, dtype)).bits // 8
        print(f"\n{model_name}: random init, {cfg['num_hidden_layers']} layers, hidden {H}, vocab {cfg['vocab_size']}; "
              f"{n} samples, {tokens:,} tokens; stored layers {layers}; {'packed' if packed else 'right-padded'}")
        runs = [time_batches(model, seqs, batches, layers, dev, pad_id, packed, TOPKS) for _ in range(a.repeats)]
        secs = {k: min(r[k] for r in runs) for k in runs[0]}
        loop = min(plain_loop(model, seqs, layers, loop_batch, dev) for _ in range(a.repeats))
        base = tokens / secs["stage"]
        print(f"  extraction tok/s: stage forward {base:,.0f}; + final hidden {tokens / secs['final']:,.0f} "
              f"({100 * (secs['final'] / secs['stage'] - 1):+.1f} % time); "
              + "; ".join(f"+ top-{k} logits {tokens / secs[f'top{k}']:,.0f} "
                          f"({100 * (secs[f'top{k}'] / secs['stage'] - 1):+.1f} % time)" for k in TOPKS)
              + f"; plain HF loop {tokens / loop:,.0f} (stage + final hidden / loop {loop / secs['final']:.2f}x)")
        stage_b = len(layers) * H * e + 8
        top_b = {k: k * (e + 4) for k in TOPKS}
        print(f"  bytes/token computed: stage {stage_b}, + final hidden {H * e} ({100 * H * e / stage_b:+.1f} %), "
              + ", ".join(f"+ top-{k} logits {top_b[k]} ({100 * top_b[k] / stage_b:+.1f} %)" for k in TOPKS))
        w = write_files(work, model, seqs[:n_write], layers, dev, pad_id, packed, TOPKS)
        meas = {k: v["bytes"] / w["tokens"] for k, v in w.items() if k != "tokens"}
        rate = sum(v["bytes"] for k, v in w.items() if k != "tokens") / sum(
            v["seconds"] for k, v in w.items() if k != "tokens") / 1e6
        print(f"  bytes/token measured (HDF5, {n_write} samples, {w['tokens']:,} tokens): "
              + ", ".join(f"{k} {v:.1f}" for k, v in meas.items()) + f"; written at {rate:,.0f} MB/s")
        ev = evaluate_side(model, seqs[:n_write], layers, dev, pad_id, packed, TOPKS)
        us = {k: 1e6 * ev[f"{k}_s"] / ev["tokens"] for k in ["final"] + [f"top{k}" for k in TOPKS]}
        print(f"  evaluate-side p(x) (T={SETTING[0]:g}, top-p {SETTING[1]}, top-k {SETTING[2]}) per token: from "
              f"final hidden {us['final']:.2f} us (LM head + filter), "
              + ", ".join(f"from top-{k} {us[f'top{k}']:.2f} us" for k in TOPKS))
        print(f"  exactness: p from final hidden vs HF logits max abs diff {ev['final_vs_hf']:.2e}; "
              + "; ".join(f"top-{k}: p at top-k {SETTING[2]} {'identical' if ev[f'top{k}_exact'] else 'DIFFERS'}, "
                          f"mass missed without top-k {ev[f'top{k}_missing']:.3f}" for k in TOPKS if k >= SETTING[2]))
        del model


if __name__ == "__main__":
    main()
