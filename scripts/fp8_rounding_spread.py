"""How far FP8 rounding alone moves the demo drafters' chain tau: tau on several equally good FP8 encodings.

    PYTHONPATH=$PWD python scripts/fp8_rounding_spread.py WORKDIR [--sets humaneval,sharegpt] [--encodings 6]
        [--drafters dflash2-smollm2-b8-step2072,dflash-smollm2-b8-step2283] [--n 16] [--max-new-tokens 256]

For each prompt set (the demo's first ``--n`` prompts and their greedy completions by the SmolLM2 demo target, on
the CPU in float32), one float32 cache is extracted and stored four ways from the same states: float32, bf16
(round to nearest even), ``cache.storage: fp8`` (:func:`dflash_eval.cache.format.quantize_fp8`: scale = amax /
448 per token and layer) and ``--encodings`` more FP8 encodings whose per-token-and-layer scale is multiplied by
``2**u``, ``u`` uniform in [0, 1) (seeded): the same format and the same error statistics (E4M3 keeps 3
mantissa bits at every magnitude), only the rounding grid sits elsewhere for each token. Each drafter is replayed
greedily on every copy (:func:`dflash_eval.stages.evaluate.evaluate`). The spread of tau over the FP8 encodings
is the part of an FP8-against-bf16 difference that rounding luck decides; a difference inside it says nothing
about the drafter. Prints one JSON line per (set, drafter). Figures: docs/measurements.md, "FP8 caches".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "scripts"))

from fp8_demo_tau import demo_completions, demo_target  # noqa: E402

from dflash_eval.cache.format import FP8_MAX  # noqa: E402
from dflash_eval.stages.evaluate import evaluate  # noqa: E402
from dflash_eval.stages.fp8_parity import restored_copy  # noqa: E402
from dflash_eval.stages.hidden_states import extract_hidden_states  # noqa: E402

SOURCES = {"humaneval": "humaneval", "sharegpt": "sharegpt"}
LAYERS = [1, 8, 15, 22, 27]  # config/demo.yaml's stored layers


def shifted_quantizer(seed: int):
    """``quantize_fp8``'s format with each token-and-layer scale multiplied by ``2**u``, u ~ U[0, 1) (``seed``):
    ``[T, K, H]`` float32 -> (``[T, K, H]`` uint8 E4M3 bits, ``[T, K]`` float32 scale)."""
    gen = torch.Generator().manual_seed(seed)

    def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf = x.float()
        scale = xf.abs().amax(dim=-1) / FP8_MAX * torch.exp2(torch.rand(xf.shape[:-1], generator=gen))
        div = torch.where(scale > 0, scale, torch.ones_like(scale))
        return (xf / div[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8), scale

    return quantize


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workdir")
    p.add_argument("--sets", default="humaneval,sharegpt")
    p.add_argument("--encodings", type=int, default=6, help="shifted FP8 encodings besides the stored one")
    p.add_argument("--drafters", default="dflash2-smollm2-b8-step2072,dflash-smollm2-b8-step2283",
                   help="comma-separated folders of demo/drafters/")
    p.add_argument("--n", type=int, default=16, help="prompts per set (config/demo.yaml: 16)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="config/demo.yaml: 256")
    a = p.parse_args(argv)
    wd = Path(a.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    target = demo_target(wd)
    rows = []
    for name in a.sets.split(","):
        comp = demo_completions(target, wd / f"{name}.jsonl", SOURCES[name], a.n, a.max_new_tokens, {})
        caches = {"f32": wd / f"{name}.f32.h5"}
        if not caches["f32"].is_file():
            extract_hidden_states(target, comp, caches["f32"], LAYERS, dtype="float32", storage="dtype", device="cpu")
        made = {"bf16": ("bfloat16", None), "fp8": ("fp8", None),
                **{f"fp8_shift{s}": ("fp8", shifted_quantizer(s)) for s in range(a.encodings)}}
        for key, (storage, quantize) in made.items():
            caches[key] = wd / f"{name}.{key}.h5"
            if not caches[key].is_file():
                restored_copy(caches["f32"], caches[key], storage, **({"quantize": quantize} if quantize else {}))
        for d in a.drafters.split(","):
            tau = {k: evaluate(str(REPO / "demo" / "drafters" / d), c, target, wd / f"eval.{name}.{d}.{k}.json",
                               device="cpu", allow_low_agreement=True, ddtree_budgets=[],
                               sampling=[{"temperature": 0.0}])["tau"] for k, c in caches.items()}
            fp8s = [tau["fp8"]] + [tau[f"fp8_shift{s}"] for s in range(a.encodings)]
            row = {"set": name, "drafter": d, "tau": {k: round(v, 4) for k, v in tau.items()},
                   "fp8_minus_bf16": round(tau["fp8"] - tau["bf16"], 4),
                   "f32_minus_bf16": round(tau["f32"] - tau["bf16"], 4),
                   "encodings_minus_bf16": [round(t - tau["bf16"], 4) for t in fp8s],
                   "encodings_mean_minus_bf16": round(statistics.mean(fp8s) - tau["bf16"], 4),
                   "encodings_sd": round(statistics.stdev(fp8s), 4)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
