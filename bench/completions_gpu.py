#!/usr/bin/env python
"""Completions on the GPU: the stage's HF source beside a plain ``model.generate`` loop, same prompts, same batches.

``--target``: a SmolLM2-135M-shaped llama (default), a Llama-3-8B-shaped llama (``llama-8b``) or an
8.16B Qwen3.5-style hybrid (``hybrid-7b``: 3 Gated DeltaNet : 1 attention, ``tests/tiny_hybrid.py``
``HYBRID_7B``; fla kernels on CUDA as a user's ``generate`` gets them, transformers' torch path on the
CPU), random weights built on the device from a transformers config (no hub access), random prompt
ids of ``--prompt-min``..``--prompt-max`` tokens, ``--max-new`` new tokens, greedy. For every batch
size in ``--batches`` (``auto`` = what the stage picks with ``generation.batch_size: 0``,
:func:`dflash_eval.target.model.decode_batch_size`) the same ``--n-batches`` length-sorted batches
(:func:`dflash_eval.core.runtime.length_batches`) run through:

- ``stage``: :class:`dflash_eval.serving.generation.TransformersSource` (what ``python -m dflash_eval
  completions`` runs: fresh greedy GenerationConfig, explicit attention mask, decode-step progress hook;
  grouped-KV SDPA; on the CPU unpadded prefill);
- ``stage, plain sdpa``: the stage without
  :func:`dflash_eval.target.model.gqa_sdpa` (``GQA_SDPA_DEVICES``), to show what it costs or saves;
- ``generate``: the loop a user writes, ``model.generate(ids, attention_mask, max_new_tokens,
  do_sample=False)`` with the default dynamic cache;
- ``generate static``: the same with ``cache_implementation="static"`` (transformers compiles the
  decode step for a static cache on CUDA; the first batch, which compiles, is timed apart), for the
  batch sizes in ``--static-batches``.

The first call (CUDA context, kernel loading; a hybrid's first fla use: Triton compile and autotune) is
timed and printed apart, and each variant's figure is its second call at the shape (``--rounds 2``).
Printed per batch size and variant: generated tokens per second (tokens up to and including the
stop id, as the stage counts them; the time covers the whole ``generate`` calls), the ratio of the
stage to the plain loop (goal >= 1.0x at every batch size), the share of rows whose token ids equal
the stage's, and at the end the memory-sized stage against the stage at batch 16 (goal >= 10x).

On one H200 (torch 2.11, transformers 5.17), from the repository root::

    python3 bench/completions_gpu.py        # ~3 min

``--ablate`` first runs one batch of the first batch size through the steps between the two: plain
``generate``; the same with the stage's ``GenerationConfig``; with its decode-step logits processor
too; the stage itself; each timed, then the stage and the plain loop under ``cProfile`` (the 15
functions with the most own time in each), to show where the stage's extra time per decode step goes::

    python3 bench/completions_gpu.py --ablate --batches 16 --static-batches ""

At a user's scale (issue #43; ``bench/hybrid_gpu.sh`` runs it with ``--target llama-8b`` too)::

    python3 bench/completions_gpu.py --target hybrid-7b --batches 64 --n-batches 1 --max-new 256 \
        --prompt-min 64 --prompt-max 512 --static-batches ""

CPU smoke run (tiny model, float32; what ``tests/bench/test_bench_smoke.py`` runs)::

    .venv/bin/python bench/completions_gpu.py --smoke
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import torch  # noqa: E402

print = functools.partial(print, flush=True)  # noqa: A001

from dflash_eval.target import model as target_mod  # noqa: E402
from dflash_eval.serving.generation import TransformersSource, cut_at_eos  # noqa: E402
from dflash_eval.core.runtime import length_batches, resolve_device, resolve_dtype  # noqa: E402
from dflash_eval.target import hybrid  # noqa: E402
import tiny_hybrid as th  # noqa: E402

#: HuggingFaceTB/SmolLM2-135M-Instruct config.json (architecture only)
SMOL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
            tie_word_embeddings=True)
TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=1024,
            tie_word_embeddings=True)
EOS, PAD = 2, 0
#: --target -> (what it is, config kwargs on the GPU, on the CPU smoke run)
TARGETS = {
    "smol": ("SmolLM2-135M-shaped llama", SMOL, TINY),
    "llama-8b": ("Llama-3-8B-shaped llama", th.LLAMA_8B, TINY),
    "hybrid-7b": ("Qwen3.5-style hybrid (3 Gated DeltaNet : 1 attention)", th.HYBRID_7B, {}),
}


def build_model(target: str, smoke: bool, dev, dt):
    """The random-init target on ``dev`` in ``dt`` (built there: an 8B model never sits in float32 on the host).

    Hybrids get the GDN kernel a user's ``generate`` gets: fla on CUDA when it imports (transformers binds it at
    import), else transformers' torch path (``dflash_eval.target.hybrid.force_backend``). Returns ``(model, kernel)``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3_5ForCausalLM

    _, big, small = TARGETS[target]
    kw = small if smoke else big
    old = torch.get_default_dtype()
    torch.manual_seed(0)
    torch.set_default_dtype(dt)
    try:
        with torch.device(dev):
            if target.startswith("hybrid"):
                conf = th.qwen35_text_config(**kw, bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)
                conf._attn_implementation = "sdpa"
                model = Qwen3_5ForCausalLM(conf).to(dt).eval()
            else:
                conf = LlamaConfig(**kw, bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD,
                                   initializer_range=0.2 if target == "smol" else 0.02,  # 8B at 0.2: bf16 overflow
                                   attn_implementation="sdpa")
                model = LlamaForCausalLM(conf).to(dt).eval()
    finally:
        torch.set_default_dtype(old)
    kernel = "none"
    if target.startswith("hybrid"):
        kernel = "fla" if dev.type == "cuda" and hybrid.fla_status()[0] else "torch"
        for m in hybrid.modeling_modules(model):
            hybrid.force_backend(m, kernel)
    return model, kernel


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def plain_generate(model, prompts, max_new, dev, static=False):
    """The plain loop on one batch: left-padded ids + mask, ``model.generate`` greedy; -> completion id lists."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), PAD, dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, P - len(p):] = torch.tensor(p)
        mask[r, P - len(p):] = 1
    kw = {"cache_implementation": "static"} if static else {}
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new,
                             do_sample=False, eos_token_id=EOS, pad_token_id=PAD, **kw)
    return [cut_at_eos(row, [EOS], max_new)[0] for row in out[:, P:].tolist()]


def ablate(model, tok, b, args, conf, dev) -> None:
    """One batch of ``b`` prompts through plain ``generate``, the steps towards the stage, the stage; then cProfile."""
    import cProfile
    import io
    import pstats

    from transformers import LogitsProcessorList

    from dflash_eval.serving.generation import DecodeSteps

    gen = torch.Generator().manual_seed(7)
    lens = torch.randint(args.prompt_min, args.prompt_max + 1, (b,), generator=gen).tolist()
    prompts = [torch.randint(3, conf.vocab_size, (L,), generator=gen).tolist() for L in lens]
    src = TransformersSource(model, tok, args.max_new, stop_ids=[EOS], batch_size=b)
    P = max(lens)
    ids = torch.full((b, P), PAD, dtype=torch.long)
    mask = torch.zeros((b, P), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, P - len(p):] = torch.tensor(p)
        mask[r, P - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)

    def gen_plain():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_new, do_sample=False,
                              eos_token_id=EOS, pad_token_id=PAD)

    def gen_config():
        return model.generate(input_ids=ids, attention_mask=mask, generation_config=src.gen_config)

    def gen_config_proc():
        return model.generate(input_ids=ids, attention_mask=mask, generation_config=src.gen_config,
                              logits_processor=LogitsProcessorList([DecodeSteps(b, args.max_new)]))

    def stage():
        return src.generate(prompts)

    variants = [("generate", gen_plain), ("+ stage GenerationConfig", gen_config),
                ("+ DecodeSteps processor", gen_config_proc), ("stage (TransformersSource.generate)", stage)]
    print(f"ablation, batch {b}, {args.max_new} new tokens (each variant run twice, the second timed):")
    for label, fn in variants:
        with torch.inference_mode():
            fn()
            sync(dev)
            t0 = time.perf_counter()
            out = fn()
            sync(dev)
        secs = time.perf_counter() - t0
        steps = (out.shape[1] - P) if torch.is_tensor(out) else max(len(x[0]) for x in out)
        print(f"  {label:36s}: {secs:6.2f} s, {steps} decode steps, {1000 * secs / max(steps, 1):6.1f} ms per step")
    for label, fn in (variants[0], variants[-1]):
        prof = cProfile.Profile()
        with torch.inference_mode():
            prof.enable()
            fn()
            sync(dev)
            prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
        print(f"cProfile of {label}, top 15 by own time:")
        print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:6000])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (checks the script)")
    ap.add_argument("--target", default="smol", choices=list(TARGETS),
                    help="random target: SmolLM2-135M-shaped llama, Llama-3-8B-shaped llama, or an 8.2B Qwen3.5-style "
                         "hybrid (fla kernels on CUDA)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batches", default="16,64,256,auto", help="batch sizes; auto = the stage's memory-sized one")
    ap.add_argument("--n-batches", type=int, default=2, help="batches timed per batch size")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds over the variants per batch size, the minimum of each reported: the first call at a "
                         "batch shape pays CUDA's per-shape warm-up (14 s at batch 64 on an H200), whichever variant "
                         "runs first")
    ap.add_argument("--static-batches", default="16,64", help="batch sizes also run with a static cache ('' = none)")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--prompt-min", type=int, default=32)
    ap.add_argument("--prompt-max", type=int, default=160)
    ap.add_argument("--ablate", action="store_true",
                    help="first time the steps between plain generate and the stage on one batch, and cProfile both")
    ap.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.device, args.static_batches, args.max_new = "cpu", "", 6
        args.batches = "2,4,auto" if args.batches == ap.get_default("batches") else args.batches
        args.prompt_min, args.prompt_max = 4, 12
    dev = resolve_device(args.device)
    dt = resolve_dtype("auto", dev)
    t_build = time.perf_counter()
    model, kernel = build_model(args.target, args.smoke, dev, dt)
    sync(dev)
    t_build = time.perf_counter() - t_build
    conf = model.config
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = EOS, PAD
    tok = types.SimpleNamespace(pad_token_id=PAD)
    gen = torch.Generator().manual_seed(1)
    sizes = []
    auto = target_mod.decode_batch_size(model, args.prompt_max, args.max_new)
    for b in args.batches.split(","):
        sizes.append(auto if b == "auto" else int(b))
    static = {int(b) for b in args.static_batches.split(",") if b}
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"device {name}, {str(dt)[6:]}, torch {torch.__version__}; target: random "
          f"{'tiny ' if args.smoke else ''}{TARGETS[args.target][0]} ({sum(p.numel() for p in model.parameters()) / 1e6:,.0f}M "
          f"parameters, built on the device in {t_build:.1f} s; linear-attention kernel: {kernel}); prompts "
          f"{args.prompt_min}-{args.prompt_max} tokens, {args.max_new} new tokens; memory-sized batch (auto) = {auto}")
    OTHER = "stage, plain sdpa"
    if args.ablate:
        ablate(model, tok, sizes[0], args, conf, dev)
    results = []
    first = True
    for b in sizes:
        n = b * args.n_batches
        lens = torch.randint(args.prompt_min, args.prompt_max + 1, (n,), generator=gen).tolist()
        prompts = [torch.randint(3, conf.vocab_size, (L,), generator=gen).tolist() for L in lens]
        batches = length_batches(lens, max_items=b)
        if first:  # warm-up (CUDA context, kernels; a hybrid's first fla use compiles them), timed apart
            sync(dev)
            t0 = time.perf_counter()
            plain_generate(model, prompts[:2], 4, dev)
            sync(dev)
            print(f"first call (2 prompts, 4 new tokens: CUDA context, kernel loading"
                  f"{', Triton compile + autotune of the fla kernels' if kernel == 'fla' else ''}): "
                  f"{time.perf_counter() - t0:.1f} s; not in any figure")
            first = False
        row = {"batch": b, "auto": b == auto, "variants": {}}
        outs = {}

        def timed(label, fn):
            sync(dev)
            t0 = time.perf_counter()
            got = fn()
            sync(dev)
            secs = time.perf_counter() - t0
            toks = sum(len(x) for x in got)
            outs[label] = got
            prev = row["variants"].get(label)
            runs = (prev["runs_s"] if prev else []) + [secs]
            best = min(runs[1:]) if len(runs) > 1 else runs[0]  # warm: the first call at this shape apart
            row["variants"][label] = {"seconds": best, "runs_s": runs, "tokens": toks, "tok_s": toks / best}
            print(f"  .. batch {b}: {label}: {toks} tokens in {secs:.2f} s")

        def stage(helper=None):
            src = TransformersSource(model, tok, args.max_new, stop_ids=[EOS], batch_size=b)
            got = {}
            with helper() if helper else contextlib.nullcontext():
                src.run(prompts, set(range(n)), lambda items: got.update({i: ids for i, ids, _, _ in items}))
            return [got[i] for i in range(n)]

        def loop(st=False):
            got = {}
            for bt in batches:
                for i, ids in zip(bt, plain_generate(model, [prompts[i] for i in bt], args.max_new, dev, static=st)):
                    got[i] = ids
            return [got[i] for i in range(n)]

        for _ in range(max(1, args.rounds)):  # interleaved rounds, the minimum of each variant
            timed("stage", stage)
            orig = target_mod.GQA_SDPA_DEVICES
            target_mod.GQA_SDPA_DEVICES = ()  # the stage without its grouped-KV SDPA
            try:
                timed(OTHER, stage)
            finally:
                target_mod.GQA_SDPA_DEVICES = orig
            timed("generate", loop)
        if b in static and dev.type == "cuda" and not args.target.startswith("hybrid"):
            bt0 = batches[0]
            sync(dev)
            t0 = time.perf_counter()
            plain_generate(model, [prompts[i] for i in bt0], args.max_new, dev, static=True)  # compiles
            sync(dev)
            row["static_first_batch_s"] = time.perf_counter() - t0
            timed("generate static", lambda: loop(True))
        ref = outs["stage"]
        print(f"batch {b}{' (auto)' if b == auto else ''}: {n} prompts in {len(batches)} batches")
        base = row["variants"]["generate"]["tok_s"]
        for label, v in row["variants"].items():
            same = sum(a == c for a, c in zip(outs[label], ref)) / n
            v["same_ids_as_stage"] = same
            print(f"  {label:18s}: {v['tok_s']:10,.0f} tok/s  ({v['tokens']} tokens, {v['seconds']:.2f} s)  "
                  f"{v['tok_s'] / base:5.2f}x generate  rows with the stage's ids {100 * same:5.1f} %  "
                  f"[calls: {', '.join(f'{x:.2f}' for x in v['runs_s'])} s; the first at this shape timed apart]")
        if "static_first_batch_s" in row:
            print(f"  (generate static: its first batch, compiling, took {row['static_first_batch_s']:.1f} s; not in the figure)")
        print(f"  ratio stage / generate ({args.target}, batch {b}, warm): "
              f"{row['variants']['stage']['tok_s'] / base:.2f}x (goal >= 1.0x)")
        results.append(row)
    s16 = next((r for r in results if r["batch"] == 16), None)
    sa = next((r for r in results if r["auto"]), None)
    if s16 and sa:
        print(f"memory-sized stage (batch {sa['batch']}) / stage at batch 16: "
              f"{sa['variants']['stage']['tok_s'] / s16['variants']['stage']['tok_s']:.1f}x (goal >= 10x)")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
