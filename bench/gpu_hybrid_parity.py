#!/usr/bin/env python
"""GPU check of hybrid-target (Gated DeltaNet) extraction: fla vs torch parity, batch invariance, timing.

What it does (one H200, < 4 min): builds a tiny random Qwen3.5 (4 layers, hidden 64) and a
~2.3B-parameter random Qwen3.5-style hybrid (24 layers [3 x GDN, 1 x gated attention], hidden
2048, GDN 16 QK / 32 V heads x 128, attention 16/2 heads x 256, FFN 6144, vocab 151936) in bf16
on the GPU; runs the pipeline's extraction (``dflash_eval.cache.extract.run_target``: forward hooks,
right padding) on synthetic samples (random ids, a few hundred tokens) with the fla and the torch
GDN kernels bound through ``dflash_eval.target.hybrid.check_bound_kernel``; reports per layer cos /
rel-L2 / max-abs for fla vs torch, each vs a float32 torch reference, batch invariance
(right-padded batch vs each sample alone) per backend, fla rerun determinism, tokens/s per
backend, and the bound-kernel description; then runs the real ``kernel-parity`` stage
(``dflash_eval.kernel_parity``) on the tiny target saved as an HF folder, with a random drafter.
Writes ``$OUT/hybrid_parity.json`` and ``$OUT/hybrid_parity.md`` and prints the markdown.

Wheels (the GPU host has torch 2.11, transformers 5.17, triton 3.6 and einops, no internet). Once,
from the repo root on a machine with PyPI, into the git-ignored ``.whl/fla``:

    python -m pip download --no-deps fla-core==0.6.0 flash-linear-attention==0.6.0 -d .whl/fla
    for v in 3.10 3.11 3.12 3.13; do python -m pip download --no-deps --only-binary=:all: \\
        --python-version $v --platform manylinux_2_28_x86_64 h5py==3.16.0 -d .whl/fla; done

(fla-core needs only einops; flash-linear-attention needs fla-core and transformers>=5.6.2,<6;
h5py is for the kernel-parity stage's HDF5 caches.) On the GPU host, from the repo root:

    python -m pip install -q --no-deps --no-index --find-links .whl/fla \\
        fla-core==0.6.0 flash-linear-attention==0.6.0 h5py==3.16.0
    FLA_FLASH_QLA=0 python bench/gpu_hybrid_parity.py

CPU smoke test (no fla: torch only, fp32 reference still compared):
``python bench/gpu_hybrid_parity.py --device cpu --tiny-only --out /tmp/hp``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import torch  # noqa: E402

import tiny_hybrid as th  # noqa: E402
from dflash_eval.target import hybrid  # noqa: E402
from dflash_eval.cache.extract import run_target  # noqa: E402
from dflash_eval.stages.kernel_parity import Parity  # noqa: E402

T0 = time.perf_counter()

BIG = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
           num_attention_heads=16, num_key_value_heads=2, head_dim=256,
           linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
           rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True})


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build(spec: str, dev):
    over = BIG if spec == "big" else {}
    if dev.type == "cuda":
        from transformers import Qwen3_5ForCausalLM

        torch.manual_seed(0)
        with torch.device(dev):
            model = Qwen3_5ForCausalLM._from_config(th.qwen35_text_config(**over), dtype=torch.bfloat16)
        return model.eval()
    return th.build_model("qwen3_5", **over).to(torch.bfloat16)


def extract(model, seqs, layers, dev):
    """(alone outputs, batched outputs, seconds alone, seconds batched); outputs = per-sample [T, K, H] CPU."""
    sync(dev)
    t = time.perf_counter()
    alone = [run_target(model, [s], layers, dev)[0][0] for s in seqs]
    sync(dev)
    t_alone = time.perf_counter() - t
    t = time.perf_counter()
    batched = [h for h, _ in run_target(model, seqs, layers, dev)]
    sync(dev)
    return alone, batched, t_alone, time.perf_counter() - t


def compare(xs, ys, layers) -> list[dict]:
    par = Parity(len(layers))
    for a, b in zip(xs, ys):
        par.add(a, b)
    return par.rows(layers)


def run_model(spec: str, dev, backends: list[str], lengths: list[int]) -> dict:
    say(f"{spec}: building")
    model = build(spec, dev)
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    layers = list(range(cfg.num_hidden_layers))
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]
    n_tok = sum(lengths)
    res: dict = {"model": spec, "params": n_params, "layer_types": list(cfg.layer_types), "lengths": lengths,
                 "hidden_size": cfg.hidden_size, "backends": {}, "comparisons": {}}
    say(f"{spec}: {n_params / 1e9:.3f}B params, {len(layers)} layers, samples {lengths}")
    out = {}
    for b in backends:
        binding = hybrid.check_bound_kernel(model, hybrid.KernelBinding(b))
        run_target(model, [seqs[0]], layers, dev)  # warm-up (Triton compilation / autotuning)
        alone, batched, t_alone, t_batch = extract(model, seqs, layers, dev)
        rerun = run_target(model, [seqs[0]], layers, dev)[0][0]
        out[b] = (alone, batched)
        res["backends"][b] = {
            "kernel": json.loads(binding.describe()),
            "tok_per_s_alone": n_tok / t_alone, "tok_per_s_batched": n_tok / t_batch,
            "rerun_bitwise_identical": bool(torch.equal(rerun.view(torch.int16), alone[0].view(torch.int16))),
        }
        res["comparisons"][f"{b} batch vs alone"] = compare(batched, alone, layers)
        say(f"{spec}/{b}: {n_tok / t_alone:.0f} tok/s alone, {n_tok / t_batch:.0f} tok/s batched; "
            f"rerun bitwise {res['backends'][b]['rerun_bitwise_identical']}")
    if "fla" in out and "torch" in out:
        res["comparisons"]["fla vs torch (alone)"] = compare(out["fla"][0], out["torch"][0], layers)
        res["comparisons"]["fla vs torch (batched)"] = compare(out["fla"][1], out["torch"][1], layers)
    say(f"{spec}: float32 torch reference")
    model.float()
    hybrid.check_bound_kernel(model, hybrid.KernelBinding("torch"))
    ref = [run_target(model, [s], layers, dev)[0][0] for s in seqs]
    for b in out:
        res["comparisons"][f"{b} bf16 vs torch fp32 (alone)"] = compare(out[b][0], ref, layers)
    del model, ref, out
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def pipeline_stage(dev, tmp: Path) -> dict:
    """The real kernel-parity stage on the tiny target folder (fla vs torch through extract_hidden_states)."""
    from safetensors.torch import save_file

    from dflash_eval.drafter.checkpoints import demo_drafter_config
    from dflash_eval.drafter.model import DFlashDrafter, DrafterConfig
    from dflash_eval.stages.kernel_parity import kernel_parity

    target = th.save_target(tmp / "tiny-qwen35", "qwen3_5", dtype=torch.bfloat16)
    comp = th.write_completions(tmp / "synthetic.jsonl", n=4, completion_len=(100, 300))
    cfg = demo_drafter_config(target, layer_ids=[0, 1, 2], block_size=8, num_layers=1)
    drafter = tmp / "random-drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in DFlashDrafter(DrafterConfig.from_dict(cfg)).state_dict().items()},
              str(drafter / "model.safetensors"))
    return kernel_parity(target, comp, [0, 1, 2, 3], tmp / "kernel_parity.json", drafters=[drafter],
                         n_samples=4, device=str(dev))


def fmt_table(res: dict) -> str:
    comps = list(res["comparisons"])
    head = "| layer | type | " + " | ".join(f"{c}: rel-L2 / cos min / max-abs" for c in comps) + " |"
    lines = [head, "|---:|---|" + "---|" * len(comps)]
    for i, t in enumerate(res["layer_types"]):
        cells = [f"{(r := res['comparisons'][c][i])['rel_l2']:.2e} / {r['cos_min']:.5f} / {r['max_abs']:.2e}" for c in comps]
        lines.append(f"| {i} | {'GDN' if t == 'linear_attention' else 'attn'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    v = report["versions"]
    lines = ["# Hybrid-target kernel parity (GPU bench)", "",
             f"Device {report['device_name']}; torch {v['torch']}, transformers {v['transformers']}, triton {v['triton']}, "
             f"fla {v['fla']}, causal-conv1d {v['causal_conv1d']}, flash_qla {v['flash_qla']}; env {report['env']}; "
             f"fla usable: {report['fla']}. Total {report['seconds']:.0f} s.", ""]
    for res in report["models"]:
        if "error" in res:
            lines += [f"## {res['model']}: FAILED", "", "```", res["error"], "```", ""]
            continue
        lines += [f"## {res['model']}: {res['params'] / 1e6:,.1f}M params, hidden {res['hidden_size']}, "
                  f"{len(res['layer_types'])} layers, samples {res['lengths']} tokens (bf16)", ""]
        for b, info in res["backends"].items():
            fns = info["kernel"]["functions"]
            chunk = sorted({f["chunk_rule"] for f in fns.values()})
            lines.append(f"- **{b}**: chunk rule `{', '.join(chunk)}`, gated norm `{info['kernel']['gated_norm']}`; "
                         f"{info['tok_per_s_alone']:.0f} tok/s alone, {info['tok_per_s_batched']:.0f} tok/s batched; "
                         f"rerun bitwise identical: {info['rerun_bitwise_identical']}")
        lines += ["", fmt_table(res), ""]
    kp = report.get("pipeline")
    if kp:
        lines += ["## kernel-parity stage on the tiny target folder", "",
                  kp.get("markdown") or "```\n" + kp.get("error", "") + "\n```", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny-only", action="store_true", help="skip the >= 1B model")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="output folder (default $OUT)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    ok, why = hybrid.fla_status()
    backends = ["fla", "torch"] if dev.type == "cuda" and ok else ["torch"]
    report = {"device": str(dev), "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "versions": hybrid.kernel_versions(), "env": hybrid.kernel_env(), "fla": why if ok else f"no ({why})",
              "backends": backends, "models": []}
    say(f"device {report['device_name']}, fla: {report['fla']}, backends {backends}")
    specs = [("tiny", [300, 180, 420, 250])]
    if not args.tiny_only:
        specs.append(("big", [512, 384, 300, 448, 256, 320]))
    for spec, lengths in specs:
        try:
            report["models"].append(run_model(spec, dev, backends, lengths))
        except Exception:  # noqa: BLE001 - keep the other measurements
            report["models"].append({"model": spec, "error": traceback.format_exc()[-4000:]})
            say(f"{spec}: FAILED\n{report['models'][-1]['error']}")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            kp = pipeline_stage(dev, Path(tmp))
        report["pipeline"] = {k: kp[k] for k in ("title", "markdown", "layers", "drafters", "plan")}
    except Exception:  # noqa: BLE001
        report["pipeline"] = {"error": traceback.format_exc()[-4000:]}
    report["seconds"] = time.perf_counter() - T0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(report)
    (out / "hybrid_parity.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "hybrid_parity.md").write_text(md + "\n")
    print(md)
    say(f"wrote {out / 'hybrid_parity.json'} and .md")
    failed = [m["model"] for m in report["models"] if "error" in m] + (["pipeline"] if "error" in report["pipeline"] else [])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
