#!/usr/bin/env python
"""Online validation's loop beside the reference loop, per sample, same target, drafter and prompts.

``dflash_eval.replay.online.spec_generate`` (what ``python -m dflash_eval validate-online`` runs per prompt,
chain mode) against ``dflash.model.dflash_generate`` (``dflash==0.1.0``, the reference loop), batch 1,
alternating per sample after one warm-up sample each. Target: random weights from a transformers
``LlamaConfig`` (``--target smol``: SmolLM2-135M's shape, as the demo; ``big``: the 2.03B llama of
``bench/replay.py``); drafter: random, ``--draft-layers`` layers of the target's width, block size
``--block-size``, saved once and loaded by both (ours: :func:`dflash_eval.drafter.model.load_drafter`; the
reference: ``DFlashDraftModel.from_pretrained``). A random drafter accepts almost nothing: every
verify step commits ~1 token, the most steps per sample (the loops' per-step cost shows fully).

Printed per sample: seconds of each loop, their ratio, whether the outputs and acceptance lists
agree; then the mean seconds per sample of each and the ratio (goal: ours <= 1.5x the reference).

The reference package: installed by ``make venv`` here; on the GPU host carry the wheel in
``.whl/dflash`` (see ``bench/replay.py``). On one H200, from the repository root::

    python3 bench/online.py                   # SmolLM2-shaped target, 6 samples x 160 tokens, < 1 min
    python3 bench/online.py --target big      # the 2B llama

CPU smoke run (tiny model; what ``tests/bench/test_bench_smoke.py`` runs)::

    .venv/bin/python bench/online.py --smoke
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402

print = functools.partial(print, flush=True)  # noqa: A001

from replay import BIG, SMOL, TINY, drafter_config, import_reference, random_target, save_drafter, sync  # noqa: E402

from dflash_eval.drafter.model import DFlashDrafter, load_drafter  # noqa: E402
from dflash_eval.drafter.config import DrafterConfig  # noqa: E402
from dflash_eval.replay.online import spec_generate  # noqa: E402
from dflash_eval.core.runtime import resolve_device, resolve_dtype  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (checks the script)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--target", choices=["smol", "big"], default="smol")
    ap.add_argument("--n", type=int, default=6, help="timed samples")
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.device, args.n, args.prompt_len, args.max_new = "cpu", 1, 8, 10
    ref = import_reference()
    if ref is None:
        raise SystemExit("the reference package dflash==0.1.0 is needed (see the docstring)")
    dev = resolve_device(args.device)
    dt = resolve_dtype("auto", dev)
    if dev.type != "cuda":
        ref._cuda_time = time.perf_counter  # the reference times with cuda.synchronize
    torch.set_grad_enabled(False)
    tcfg = TINY if args.smoke else (SMOL if args.target == "smol" else BIG)
    target = random_target(tcfg, dev, dt)
    n_layers = tcfg["num_hidden_layers"]
    layer_ids = sorted({round(1 + i * (n_layers - 3) / 4) for i in range(5)})
    raw = drafter_config(tcfg, args.draft_layers, args.block_size, layer_ids)
    torch.manual_seed(2)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_drafter(DFlashDrafter(DrafterConfig.from_dict(raw)).to(dt), raw, Path(tmp) / "d")
        drafter = load_drafter(folder, device=dev, dtype=dt)
        ref_drafter = ref.DFlashDraftModel.from_pretrained(str(folder), dtype=dt).to(dev).eval()
    embed = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings().weight.detach()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, tcfg["vocab_size"] - 1, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.n + 1)]
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"device {name}, {str(dt)[6:]}, torch {torch.__version__}; random {args.target if not args.smoke else 'tiny'} "
          f"target ({sum(p.numel() for p in target.parameters()) / 1e9:.2f}B), random {args.draft_layers}-layer drafter "
          f"B={args.block_size}; {args.n} samples of {args.prompt_len} + {args.max_new} tokens, chain, batch 1")

    def ours(p):
        o = spec_generate(target, drafter, embed, head, p, args.max_new, [])
        return o.completion_ids, o.acceptance_lengths

    def theirs(p):
        o = ref.dflash_generate(ref_drafter, target, torch.tensor([p], device=dev), max_new_tokens=args.max_new,
                                stop_token_ids=None, return_stats=True)
        return o.output_ids[0, len(p):].tolist(), list(o.acceptance_lengths)

    def timed(fn, p):
        sync(dev)
        t0 = time.perf_counter()
        got = fn(p)
        sync(dev)
        return got, time.perf_counter() - t0

    timed(ours, prompts[0])  # warm-up, not timed
    timed(theirs, prompts[0])
    rows = []
    for i, p in enumerate(prompts[1:]):
        (o_ids, o_acc), t_o = timed(ours, p)
        (r_ids, r_acc), t_r = timed(theirs, p)
        rows.append({"ours_s": t_o, "ref_s": t_r, "steps": len(o_acc), "same_output": o_ids == r_ids,
                     "same_acceptance": o_acc == r_acc})
        print(f"  sample {i}: ours {t_o:7.3f} s ({len(o_acc)} steps), reference {t_r:7.3f} s ({len(r_acc)} steps): "
              f"{t_o / t_r:5.2f}x; same output {o_ids == r_ids}, same acceptance {o_acc == r_acc}")
    mo = sum(r["ours_s"] for r in rows) / len(rows)
    mr = sum(r["ref_s"] for r in rows) / len(rows)
    print(f"per sample: ours {mo:.3f} s, reference dflash_generate {mr:.3f} s -> ratio {mo / mr:.2f}x (goal <= 1.5x)")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "ours_s": mo, "ref_s": mr}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
