#!/usr/bin/env python
"""Replay speed, side by side in one run: batched all-anchor replay vs the sequential replay vs the
reference online loop (``dflash.model.dflash_generate``), plus achieved TFLOP/s of the batched pass.

Cases:

(i) ``smollm2`` -- the three committed demo drafters (``demo/drafters/*``, 2 layers, B=8) on a
    SmolLM2-135M-shaped target. The real target (a 98 MB GGUF, 270 MB as bf16 safetensors) does
    not fit what travels to the GPU host (64 MiB), so by default the target is **built with random
    weights from SmolLM2-135M-Instruct's config** (:data:`SMOL`); ``--smol-target DIR`` uses a real
    HF folder instead (e.g. ``resources/targets/smollm2-135m-instruct`` after ``make demo``). With
    the random target the drafters accept almost nothing (tau ~1: the most verify steps, the worst
    case for the sequential replay and the online loop), so tau is printed next to every time.
    Samples: random prompts, the target's greedy completions (HF ``generate``), hidden states from
    the pipeline's extraction hooks (``extract.run_target``), kept in memory.
(ii) ``big`` -- a random llama-style target from a transformers ``LlamaConfig`` (:data:`BIG`:
    hidden 2048, 24 layers, 16/8 heads of 128, FFN 8192, vocab 128256, untied: 2.03B parameters)
    and a random drafter (``--big-draft-layers``, default 1 layer, B=16, 5 target layers); samples
    of ``--big-prompt`` + ``--big-new`` (default 128 + 1024) tokens with random ids and random
    hidden states (the replay's cost does not depend on their values; a random drafter accepts
    ~nothing either way). The online loop decodes the same prompts for ``--big-new`` tokens with no
    stop token, the target in the loop.
(iii) ``dflash2`` -- the same target, samples and block size as (ii) with a random **DFlash 2**
    drafter (grouped dynamic causal conv + candidate selector, the fields of
    ``dflash_eval.drafter.demo.DFLASH2_DEMO_FIELDS``: 2 taps, groups of 16, rank 256, top-16; conv taps near
    the identity, codebooks large enough that the selector leaves the argmax), so its batched /
    sequential / online times sit beside DFlash 1's at the same B. Its online loop is the reference
    ``dflash_generate`` with ``DFlash2DraftModel`` (the stripped layout loads into it).
(iv) ``real`` -- a drafter of the size users train: 5 layers of hidden 4096 (heads 32/8 of 128, FFN
    12288; a Qwen3-8B-shaped target's vocabulary 151936, B=16), random weights, with a random ``[V, H]``
    embedding and LM head in place of the target's (the replay reads only those), on ``--real-n``
    samples of ``--real-prompt`` + ``--real-new`` = 1k tokens. Per layout: ms/sample, the executed
    TFLOP/s of the all-anchor pass next to the GEMM rate measured in the same run (goal >= 40 %),
    and the projected time of one checkpoint's replay on ``--real-project`` (1,000) samples. No
    sequential replay and no online loop here (no target of that size is loaded).

Progress: a line ``.. [case] <phase>: <s>`` after every timed phase, so a slow phase shows at once.

Printed per case (i) and (ii): wall seconds (and per sample) of the batched replay in both layouts (``rows``
and ``packed``, memory-sized chunks; the device's default layout, ``replay.DEFAULT_LAYOUT``, is
the one in the ratios), the sequential replay (memory-sized batches; ``--seq-batch`` caps them),
and the online loop (batch 1, on the first ``--online-samples`` samples), the ratios, tau of each,
how many samples' acceptance lists differ between batched and sequential (with the near-tie behind
each, top-2 logit gap in ulps), and the FLOPs each batched pass executed divided by its time, next
to a measured dense GEMM rate in the same dtype. Warm-up: each batched layout first runs on two
samples; the sequential replay and the online loop run cold (their per-step work is small). Goals: batched >= 20x sequential at 1k tokens; offline tau of one
checkpoint >= 50x faster than online decoding of the same samples.

The reference package: ``dflash==0.1.0`` is installed ``--no-deps`` by ``make venv`` here; the GPU
host has no network and no ``dflash``, so carry the wheel in the git-ignored ``.whl/dflash``:

    python -m pip download --no-deps dflash==0.1.0 -d .whl/dflash      # once, where PyPI is reachable

This script puts ``.whl/dflash/dflash-*.whl`` on ``sys.path`` when ``import dflash`` fails (a
pure-Python wheel imports from the zip); without either, the online loop is this package's
:func:`dflash_eval.replay.online.spec_generate` (chain, batch 1) and the output says so. On one H200,
from the repo root:

    python bench/replay.py --case real          # the real-size drafter alone, bf16 (~1-2 min)
    python bench/replay.py --case big           # one case
    python bench/replay.py --case dflash2       # DFlash 2 beside (ii): same target, samples, B=16
    python bench/replay.py                      # every case, bf16 (several minutes: the online loops)

CPU smoke run (tiny sizes, float32; what the CI-free check here runs):

    .venv/bin/python bench/replay.py --smoke
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import math
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

print = functools.partial(print, flush=True)  # noqa: A001  (progress shows up in redirected logs)

from dflash_eval.cache.format import CacheSample# noqa: E402
from dflash_eval.cache.extract import run_target  # noqa: E402
from dflash_eval.drafter.model import DFlashDrafter, load_drafter  # noqa: E402
from dflash_eval.drafter.demo import DFLASH2_DEMO_FIELDS  # noqa: E402
from dflash_eval.drafter.config import DrafterConfig  # noqa: E402
from dflash_eval.replay.metrics import aggregate  # noqa: E402
from dflash_eval.replay import anchors  # noqa: E402  (--groups-sweep sets its sizes)
from dflash_eval.replay.anchors import DEFAULT_LAYOUT, LAYOUTS, replay_batched  # noqa: E402
from dflash_eval.replay.chain import explain_differences, replay# noqa: E402
from dflash_eval.core.runtime import free_memory_bytes# noqa: E402

#: SmolLM2-135M-Instruct's architecture (HuggingFaceTB/SmolLM2-135M-Instruct config.json)
SMOL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
#: a >= 1.5B llama-style target (Llama-3.2 layout, deeper): 2.03B parameters, 1.51B outside embeddings
BIG = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=16,
           num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
           tie_word_embeddings=False)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
            tie_word_embeddings=False)
SMOL_LAYERS = [1, 8, 15, 22, 27]  # the demo drafters' target_layer_ids


def import_reference():
    """``dflash.model`` from the installed package, else from ``.whl/dflash/dflash-*.whl`` (zip import)."""
    try:
        import dflash.model as ref
        return ref
    except ImportError:
        wheels = sorted(glob.glob(str(REPO / ".whl" / "dflash" / "dflash-*.whl")))
        if not wheels:
            print("# dflash is not installed and .whl/dflash/dflash-*.whl is missing: the online loop is "
                  "dflash_eval.replay.online.spec_generate (chain; lossless and step-identical to the offline replay in "
                  "float32, tests/replay/test_online.py), not dflash.model.dflash_generate. For the reference: "
                  "`python -m pip download --no-deps dflash==0.1.0 -d .whl/dflash` where PyPI is reachable")
            return None
        sys.path.insert(0, wheels[-1])
        import dflash.model as ref
        return ref


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(dev, fn):
    sync(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return out, time.perf_counter() - t0


def gemm_rate(dev, dt) -> float:
    """Dense GEMM TFLOP/s in ``dt`` (n x n by n x n, best of a few)."""
    n = 8192 if dev.type == "cuda" else 1024
    a = torch.randn(n, n, device=dev, dtype=dt)
    b = torch.randn(n, n, device=dev, dtype=dt)
    a @ b
    best = float("inf")
    for _ in range(5 if dev.type == "cuda" else 2):
        _, t = timed(dev, lambda: [a @ b for _ in range(10 if dev.type == "cuda" else 1)])
        best = min(best, t / (10 if dev.type == "cuda" else 1))
    return 2 * n ** 3 / best / 1e12


def progress(name: str, what: str, t0: float) -> None:
    print(f"  .. [{name}] {what} ({time.perf_counter() - t0:.0f} s into the case)")


def batched_flops(cfg, stats: dict, vocab: int) -> float:
    """FLOPs the batched pass executed (matmuls only, padding rows of the ``groups`` layout included), from
    :func:`iter_anchor_drafts` ``stats``."""
    H, I, nh, nkv, hd, L = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                            cfg.head_dim, cfg.num_hidden_layers)
    layer = H * nh * hd * 2 + H * nkv * hd * 2 + 3 * H * I  # q, o, k, v, MLP
    ctx = len(cfg.target_layer_ids) * H * H + L * 2 * H * nkv * hd  # fc, per-layer context k/v
    q = stats["query_tokens"] + stats.get("pad_query_tokens", 0)
    return (2 * q * layer * L + 2 * stats["context_tokens"] * ctx
            + 4 * stats["attn_pairs"] * nh * hd * L + 2 * stats["head_rows"] * H * vocab)


def random_target(cfg: dict, dev, dt):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation="sdpa"))
    return model.to(dt).eval()


def save_drafter(drafter: DFlashDrafter, raw_cfg: dict, folder: Path) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw_cfg))
    save_file({k: v.detach().to("cpu").contiguous() for k, v in drafter.state_dict().items()}, str(folder / "model.safetensors"))
    return folder


def drafter_config(tcfg: dict, layers: int, block_size: int, layer_ids: list[int]) -> dict:
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": tcfg["hidden_size"],
            "intermediate_size": tcfg["intermediate_size"], "num_attention_heads": tcfg["num_attention_heads"],
            "num_key_value_heads": tcfg["num_key_value_heads"], "head_dim": tcfg["head_dim"],
            "num_hidden_layers": layers, "num_target_layers": tcfg["num_hidden_layers"],
            "rms_norm_eps": tcfg["rms_norm_eps"], "rope_theta": tcfg["rope_theta"],
            "max_position_embeddings": tcfg["max_position_embeddings"], "vocab_size": tcfg["vocab_size"],
            "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "block_size": block_size,
            "dflash_config": {"target_layer_ids": layer_ids, "mask_token_id": tcfg["vocab_size"] - 1,
                              "block_size": block_size}}


def online(ref, ref_drafter, target, samples, max_new: int, stop, dev, drafter=None, embed=None, head=None):
    """Online loop per sample (batch 1): ``(seconds, [acceptance lists], [output ids])``.

    ``ref`` = ``dflash.model``: the reference ``dflash_generate``; ``ref = None``: our
    :func:`dflash_eval.replay.online.spec_generate` (chain) with ``drafter``/``embed``/``head``.
    """
    from dflash_eval.replay.online import spec_generate

    accs, outs = [], []

    def run():
        for s in samples:
            if ref is None:
                o = spec_generate(target, drafter, embed, head, s.input_ids[: s.prompt_len].tolist(), max_new,
                                  list(stop or []))
                accs.append(o.acceptance_lengths)
                outs.append(list(o.completion_ids))
                continue
            o = ref.dflash_generate(ref_drafter, target, s.input_ids[: s.prompt_len][None].to(dev),
                                    max_new_tokens=max_new, stop_token_ids=stop, return_stats=True)
            accs.append(o.acceptance_lengths)
            outs.append(o.output_ids[0, s.prompt_len:].tolist())
    _, t = timed(dev, run)
    return t, accs, outs


def compare(name, drafter, embed, head, samples, ref, ref_drafter, target, max_new, stop, args, dev, dt, flops_rate):
    n = len(samples)
    B = drafter.cfg.block_size
    mem = free_memory_bytes(dev)
    bat, t_bat, stats = {}, {}, {}
    t_case = time.perf_counter()
    for layout in LAYOUTS:  # every layout of the batched replay; the device's default is the headline
        stats[layout] = {}
        replay_batched(drafter, embed, head, samples[: min(2, n)], memory_bytes=mem, layout=layout)  # warm-up
        bat[layout], t_bat[layout] = timed(dev, lambda: replay_batched(drafter, embed, head, samples, memory_bytes=mem,
                                                                       layout=layout, stats=stats[layout]))
        progress(name, f"batched {layout}: {t_bat[layout]:.2f} s", t_case)
    default = DEFAULT_LAYOUT.get(dev.type, "rows")
    seq, t_seq = timed(dev, lambda: replay(drafter, embed, head, samples, mode="sequential", memory_bytes=mem,
                                           batch_size=args.seq_batch))
    progress(name, f"sequential: {t_seq:.2f} s", t_case)
    k = min(args.online_samples, n)
    if k:
        t_onl, onl, outs = online(ref, ref_drafter, target, samples[:k], max_new, stop, dev, drafter, embed, head)
        progress(name, f"online loop, {k} samples: {t_onl:.2f} s", t_case)
    else:  # --online-samples 0: batched vs sequential only
        t_onl, onl, outs, k = math.nan, [], [], 1
    tau = lambda recs: aggregate(recs, B).tau  # noqa: E731
    tokens = sum(len(s.input_ids) - s.prompt_len for s in samples)
    tb = t_bat[default]
    print(f"[{name}] {n} samples, {tokens / n:.0f} completion tokens/sample, B={B}, {dev.type} {str(dt)[6:]}")
    for layout in LAYOUTS:
        mark = " (default)" if layout == default else ""
        print(f"  batched {layout:7s}{mark:10s}: {t_bat[layout]:8.2f} s  ({t_bat[layout] / n * 1e3:8.1f} ms/sample)  "
              f"tau {tau(bat[layout]):.4f}")
    print(f"  sequential                : {t_seq:8.2f} s  ({t_seq / n * 1e3:8.1f} ms/sample)  tau {tau(seq):.4f}")
    if onl:
        print(f"  online loop ({'dflash' if ref is not None else 'ours'})        : {t_onl:8.2f} s  ({t_onl / k * 1e3:8.1f} ms/sample, {k} samples)  "
              f"tau {tau(onl):.4f}")
    print(f"  ratio sequential / batched ({default})        : {t_seq / tb:8.1f}x   (goal >= 20x at 1k tokens)")
    print(f"  ratio online / batched ({default}), per sample : {(t_onl / k) / (tb / n):8.1f}x   (goal >= 50x)")
    print(f"  ratio online / sequential, per sample      : {(t_onl / k) / (t_seq / n):8.1f}x")
    same_out = [i for i in range(len(outs)) if outs[i] == samples[i].input_ids[samples[i].prompt_len:].tolist()]
    print(f"  online output == cached completion: {len(same_out)}/{k} samples; of those, batched acceptance == online: "
          f"{sum(bat[default][i] == onl[i] for i in same_out)}/{len(same_out)}")
    for layout in LAYOUTS:
        diff = [i for i in range(n) if bat[layout][i] != seq[i]]
        print(f"  batched {layout} != sequential: {len(diff)}/{n} samples")
        for row in explain_differences(drafter, embed, head, [samples[i] for i in diff[:8]],
                                       [bat[layout][i] for i in diff[:8]], [seq[i] for i in diff[:8]]):
            if "slot" not in row:
                print(f"    {row}")
                continue
            print(f"    sample {row['sample_id']} anchor {row['anchor']} slot {row['slot']}: batched {row['n_first']} vs "
                  f"sequential {row['n_second']} tokens; target token {row['target_token']}, top-2 "
                  f"{row['top1']}/{row['top2']}, top-1 logit {row['top1_logit']:.3f}, top-2 gap {row['gap']:.4f} "
                  f"= {row['gap_ulps']:.1f} ulps, target margin {row['target_margin']:+.4f}")
    for layout in LAYOUTS:
        st = stats[layout]
        fl = batched_flops(drafter.cfg, st, head.shape[0])
        print(f"  batched {layout} pass: {st['calls']} drafter calls, {st['query_tokens']} query tokens "
              f"(+{st.get('pad_query_tokens', 0)} padding), "
              f"{st['head_rows']} LM-head rows; {fl / 1e9:.1f} GFLOP executed -> {fl / t_bat[layout] / 1e12:.3f} TFLOP/s "
              f"({100 * fl / t_bat[layout] / 1e12 / flops_rate:.1f} % of the measured {flops_rate:.3f} TFLOP/s GEMM rate)")
    return {"case": name, "n": n, "batched_s": t_bat, "default_layout": default, "sequential_s": t_seq,
            "online_s": t_onl, "online_n": k, "online_loop": "dflash" if ref is not None else "dflash_eval.replay.online",
            "tau_batched": {x: tau(bat[x]) for x in LAYOUTS},
            "tau_sequential": tau(seq), "tau_online": tau(onl) if onl else None,
            "differ": {x: sum(bat[x][i] != seq[i] for i in range(n)) for x in LAYOUTS}, "gemm_tflops": flops_rate}


def case_smol(args, ref, dev, dt, rate):
    from dflash_eval.target.model import load_target

    if args.smol_target:
        target, _, _ = load_target(args.smol_target, device=dev, dtype=dt)
        label = f"SmolLM2 target {args.smol_target}"
    else:
        target = random_target(SMOL, dev, dt)
        label = "random SmolLM2-135M-shaped target"
    print(f"# (i) demo drafters on a {label}")
    gen = torch.Generator().manual_seed(1)
    vocab = target.config.vocab_size
    prompts = torch.randint(3, vocab - 1, (args.smol_n, args.prompt_len), generator=gen)
    stop = [target.config.eos_token_id] if target.config.eos_token_id is not None else None
    seqs = []
    with torch.inference_mode():
        for b0 in range(0, args.smol_n, 64):
            out = target.generate(prompts[b0:b0 + 64].to(dev), max_new_tokens=args.smol_new, do_sample=False,
                                  eos_token_id=stop, pad_token_id=0)
            for row in out.cpu():
                ids = row.tolist()
                cut = len(ids)
                for j in range(args.prompt_len, len(ids)):
                    if stop and ids[j] in stop:
                        cut = j + 1
                        break
                seqs.append(ids[:cut])
        samples = []
        for b0 in range(0, len(seqs), 16):
            for ids, (hidden, _) in zip(seqs[b0:b0 + 16], run_target(target, seqs[b0:b0 + 16], SMOL_LAYERS, dev)):
                t = torch.tensor(ids)
                samples.append(CacheSample(len(samples), f"s{len(samples)}", t, args.prompt_len, hidden, t.clone(),
                                           "eos", args.smol_new))
    embed = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings().weight.detach()
    results = []
    folders = sorted((REPO / "demo" / "drafters").glob("dflash-smollm2-*"))
    for folder in folders[:1] if args.smoke else folders:
        drafter = load_drafter(folder, device=dev, dtype=dt)
        ref_drafter = (ref.DFlashDraftModel.from_pretrained(str(folder), dtype=dt).to(dev).eval()
                       if ref is not None else None)
        results.append(compare(f"smollm2 {folder.name}", drafter, embed, head, samples, ref, ref_drafter, target,
                               args.smol_new, stop, args, dev, dt, rate))
    return results


def dflash2_fields(tcfg: dict) -> dict:
    """The DFlash 2 fields of the bench's DFlash 2 drafter (:data:`dflash_eval.drafter.demo.DFLASH2_DEMO_FIELDS`, capped)."""
    f = dict(DFLASH2_DEMO_FIELDS)
    f["selector_rank"] = min(f["selector_rank"], tcfg["hidden_size"])
    f["selector_top_k"] = min(f["selector_top_k"], tcfg["vocab_size"])
    return f


def randomize_dflash2(drafter: DFlashDrafter) -> DFlashDrafter:
    """Conv taps near the identity (tap 0 = 1 + noise, later taps noise), codebooks ~ N(0, 1/rank) * 3: non-trivial."""
    gen = torch.Generator().manual_seed(4)
    for name, p in drafter.named_parameters():
        if name.endswith("base_kernel"):
            k = 0.1 * torch.randn(p.shape, generator=gen)
            k[:, 0] += 1.0
            p.data.copy_(k)
        elif "codebook" in name:
            p.data.copy_(3.0 / p.shape[-1] ** 0.5 * torch.randn(p.shape, generator=gen))
    return drafter


def case_big(args, ref, dev, dt, rate, variant: str = "dflash"):
    tcfg = TINY if args.smoke else BIG
    target = random_target(tcfg, dev, dt)
    nparams = sum(p.numel() for p in target.parameters())
    label = "(iii) DFlash 2" if variant == "dflash2" else "(ii)"
    print(f"# {label} random llama-style target, {nparams / 1e9:.2f}B parameters, random {args.big_draft_layers}-layer "
          f"{'DFlash 2 ' if variant == 'dflash2' else ''}drafter")
    n_layers = tcfg["num_hidden_layers"]
    layer_ids = sorted({round(1 + i * (n_layers - 3) / 4) for i in range(5)})
    raw = drafter_config(tcfg, args.big_draft_layers, 16, layer_ids)
    if variant == "dflash2":
        raw["dflash_config"].update(dflash2_fields(tcfg))
        raw["architectures"] = ["DFlash2DraftModel"]
    torch.manual_seed(2)
    drafter = DFlashDrafter(DrafterConfig.from_dict(raw))
    if variant == "dflash2":
        randomize_dflash2(drafter)
    drafter = drafter.to(device=dev, dtype=dt).eval()
    ref_drafter = None
    if ref is not None:
        ref_cls = ref.DFlash2DraftModel if variant == "dflash2" else ref.DFlashDraftModel
        with tempfile.TemporaryDirectory() as tmp:
            ref_drafter = ref_cls.from_pretrained(str(save_drafter(drafter, raw, Path(tmp) / "d")), dtype=dt).to(dev).eval()
    gen = torch.Generator().manual_seed(3)
    P, N = args.big_prompt, args.big_new
    samples = []
    for i in range(args.big_n):
        ids = torch.randint(0, tcfg["vocab_size"] - 1, (P + N,), generator=gen)
        hidden = torch.randn(P + N, len(layer_ids), tcfg["hidden_size"], generator=gen).to(dt)
        samples.append(CacheSample(i, f"r{i}", ids, P, hidden, ids.clone(), "length", N))
    embed = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings().weight.detach()
    return [compare("big" if variant == "dflash" else "big dflash2", drafter, embed, head, samples, ref, ref_drafter,
                    target, N, None, args, dev, dt, rate)]


#: a drafter of the size users train (z-lab's Qwen3-8B drafters: 5 layers over a hidden-4096 target)
REAL = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
            num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
            tie_word_embeddings=False)
REAL_SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096,
                  tie_word_embeddings=False)


def case_real(args, dev, dt, rate):
    """A 5-layer drafter of hidden 4096 (B=16) on ``--real-n`` samples of ``--real-prompt`` + ``--real-new`` tokens.

    Random drafter weights, a random ``[V, H]`` embedding and LM head standing in for the target's
    (no target is loaded: the replay reads only those two), random ids and hidden states. Per layout:
    ms/sample, the executed TFLOP/s of the all-anchor pass against the GEMM rate measured in the run,
    and the projected time of one checkpoint's replay on ``--real-project`` samples.
    """
    tcfg = REAL_SMOKE if args.smoke else REAL
    n_layers = tcfg["num_hidden_layers"]
    layer_ids = sorted({round(1 + i * (n_layers - 3) / 4) for i in range(5)})
    raw = drafter_config(tcfg, 5, 16, layer_ids)
    torch.manual_seed(4)
    with torch.device(dev):  # random init of ~1B parameters: on the device, not the host
        drafter = DFlashDrafter(DrafterConfig.from_dict(raw))
    drafter = drafter.to(device=dev, dtype=dt).eval()
    n_par = sum(p.numel() for p in drafter.parameters())
    V, H = tcfg["vocab_size"], tcfg["hidden_size"]
    gen = torch.Generator(device=dev).manual_seed(5)
    embed = (torch.randn(V, H, generator=gen, device=dev, dtype=torch.float32) * 0.02).to(dt)
    head = (torch.randn(V, H, generator=gen, device=dev, dtype=torch.float32) * 0.02).to(dt)
    P, N = args.real_prompt, args.real_new
    cpu_gen = torch.Generator().manual_seed(6)
    samples = []
    for i in range(args.real_n):
        ids = torch.randint(0, V - 1, (P + N,), generator=cpu_gen)
        hidden = torch.randn(P + N, len(layer_ids), H, generator=cpu_gen).to(dt)
        samples.append(CacheSample(i, f"q{i}", ids, P, hidden, ids.clone(), "length", N))
    name = "real"
    print(f"# (iv) 5-layer hidden-{H} drafter ({n_par / 1e9:.2f}B parameters, B=16, target layers {layer_ids}), "
          f"{args.real_n} samples of {P} + {N} tokens, random weights, {dev.type} {str(dt)[6:]}")
    mem = free_memory_bytes(dev)
    t_case = time.perf_counter()
    out = {"case": name, "n": args.real_n, "tokens_per_sample": P + N, "gemm_tflops": rate, "layouts": {}}
    taus = {}
    for layout in LAYOUTS:
        st = {}
        replay_batched(drafter, embed, head, samples[:1], memory_bytes=mem, layout=layout)  # warm-up
        recs, t = timed(dev, lambda: replay_batched(drafter, embed, head, samples, memory_bytes=mem, layout=layout,
                                                    stats=st))
        taus[layout] = aggregate(recs, 16).tau
        fl = batched_flops(drafter.cfg, st, V)
        ms = t / args.real_n * 1e3
        tf = fl / t / 1e12
        mark = " (default)" if layout == DEFAULT_LAYOUT.get(dev.type, "rows") else ""
        print(f"  batched {layout:7s}{mark:10s}: {ms:9.1f} ms/sample; {fl / args.real_n / 1e12:.2f} TFLOP/sample "
              f"executed ({st['calls']} drafter calls, {st.get('pad_query_tokens', 0)} padding query tokens) -> "
              f"{tf:8.2f} TFLOP/s = {100 * tf / rate:5.1f} % of the measured GEMM rate (goal >= 40 %); projected "
              f"{ms * args.real_project / 1e3:7.1f} s per checkpoint for {args.real_project} samples; tau {taus[layout]:.4f}")
        out["layouts"][layout] = {"seconds": t, "ms_per_sample": ms, "tflops": tf, "gemm_fraction": tf / rate,
                                  "projected_s": ms * args.real_project / 1e3, "tau": taus[layout]}
        progress(name, f"batched {layout}: {t:.2f} s", t_case)
    print(f"  tau identical across layouts: {len(set(taus.values())) == 1}")
    if args.finite_check_cost:  # the drafted states' NaN / inf watch (DFlashDrafter.logits), on and off, interleaved
        layout, times = DEFAULT_LAYOUT.get(dev.type, "rows"), {True: [], False: []}
        try:
            for _ in range(3):
                for on in (True, False):
                    DFlashDrafter.check_finite = on
                    _, t = timed(dev, lambda: replay_batched(drafter, embed, head, samples, memory_bytes=mem,
                                                             layout=layout))
                    times[on].append(t)
        finally:
            DFlashDrafter.check_finite = True
        on, off = min(times[True]), min(times[False])
        print(f"  finite-state check ({layout}): {on / args.real_n * 1e3:.1f} ms/sample with, {off / args.real_n * 1e3:.1f} "
              f"without (min of 3, interleaved): ratio {on / off:.4f} (goal <= 1.05)")
        out["finite_check"] = {"layout": layout, "with_s": on, "without_s": off, "ratio": on / off}
    if args.groups_sweep:  # the groups layout's two sizes: query tokens per row, query tokens per drafter call
        out["groups_sweep"] = []
        saved = anchors.GROUP_QUERIES, dict(anchors.MAX_CHUNK_TOKENS)
        try:
            for spec in args.groups_sweep.split(","):
                gq, chunk = (int(x) for x in spec.split("x"))
                anchors.GROUP_QUERIES = gq
                anchors.MAX_CHUNK_TOKENS[("groups", dev.type)] = chunk
                st = {}
                replay_batched(drafter, embed, head, samples[:1], memory_bytes=mem, layout="groups")  # warm-up
                recs, t = timed(dev, lambda: replay_batched(drafter, embed, head, samples, memory_bytes=mem,
                                                            layout="groups", stats=st))
                fl = batched_flops(drafter.cfg, st, V)
                ms, tf = t / args.real_n * 1e3, fl / t / 1e12
                useful = batched_flops(drafter.cfg, {**st, "pad_query_tokens": 0}, V)
                tau_g = aggregate(recs, 16).tau
                print(f"  groups {gq:4d} queries/row, {chunk:6d} queries/call: {ms:8.1f} ms/sample; "
                      f"{fl / args.real_n / 1e12:.2f} TFLOP/sample executed -> {100 * tf / rate:5.1f} % of GEMM; "
                      f"{st['calls']} calls; tau {tau_g:.4f} (same as above: {tau_g == taus['groups']})")
                out["groups_sweep"].append({"group_queries": gq, "chunk_tokens": chunk, "ms_per_sample": ms,
                                            "gemm_fraction": tf / rate, "tflop_per_sample": fl / args.real_n / 1e12,
                                            "tflop_per_sample_no_padding": useful / args.real_n / 1e12, "tau": tau_g})
                progress(name, f"groups {spec}: {t:.2f} s", t_case)
        finally:
            anchors.GROUP_QUERIES, anchors.MAX_CHUNK_TOKENS = saved[0], saved[1]
    return [out]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=["all", "smollm2", "big", "dflash2", "real"], default="all",
                    help="all = smollm2 + big + dflash2 + real")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check of the script)")
    ap.add_argument("--smol-target", default=None, help="real SmolLM2 HF folder (default: random weights from its config)")
    ap.add_argument("--smol-n", type=int, default=64)
    ap.add_argument("--smol-new", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--big-n", type=int, default=64)
    ap.add_argument("--big-prompt", type=int, default=128)
    ap.add_argument("--big-new", type=int, default=1024)
    ap.add_argument("--big-draft-layers", type=int, default=1)
    ap.add_argument("--online-samples", type=int, default=4, help="samples decoded by the online loop (per drafter; 0 = no online loop)")
    ap.add_argument("--seq-batch", type=int, default=0, help="cap on the sequential replay's batch (0 = memory-sized)")
    ap.add_argument("--real-n", type=int, default=32, help="samples of the real-size drafter case")
    ap.add_argument("--real-prompt", type=int, default=128)
    ap.add_argument("--real-new", type=int, default=896, help="completion tokens (prompt + completion = 1k tokens)")
    ap.add_argument("--real-project", type=int, default=1000, help="samples per checkpoint in the projected time")
    ap.add_argument("--groups-sweep", default="", metavar="QxC,...",
                    help="real case: also time the groups layout at Q query tokens per row and C query tokens per "
                         "drafter call, e.g. 128x16384,256x16384 (the defaults: anchors.GROUP_QUERIES, "
                         "anchors.MAX_CHUNK_TOKENS)")
    ap.add_argument("--finite-check-cost", action="store_true",
                    help="real case: time the default layout with and without the drafted states' NaN / inf watch "
                         "(DFlashDrafter.check_finite), interleaved, and print the ratio (goal <= 1.05)")
    ap.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.smol_n, args.smol_new, args.prompt_len = 2, 12, 8
        args.big_n, args.big_prompt, args.big_new, args.online_samples = 3, 16, 48, min(args.online_samples, 1)
        args.real_n, args.real_prompt, args.real_new = 2, 16, 48
    from dflash_eval.core.runtime import resolve_device, resolve_dtype

    dev = resolve_device(args.device)
    dt = resolve_dtype(args.dtype, dev)
    ref = import_reference()
    if dev.type != "cuda" and ref is not None:
        ref._cuda_time = time.perf_counter  # the reference times with cuda.synchronize
    torch.set_grad_enabled(False)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    rate = gemm_rate(dev, dt)
    print(f"device {name}, dtype {str(dt)[6:]}, torch {torch.__version__}; measured GEMM {rate:.3f} TFLOP/s; "
          f"replay memory plan {free_memory_bytes(dev) / 2**30:.1f} GiB")
    results = []
    if args.case in ("all", "smollm2"):
        results += case_smol(args, ref, dev, dt, rate)
    if args.case in ("all", "big"):
        results += case_big(args, ref, dev, dt, rate)
    if args.case in ("all", "dflash2"):
        results += case_big(args, ref, dev, dt, rate, variant="dflash2")
    if args.case in ("all", "real"):
        results += case_real(args, dev, dt, rate)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
