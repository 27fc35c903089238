"""The dflash-eval image (containers/cuda/Dockerfile).

Static checks of the recipes and of ``check_image.py``, the causal-conv1d status recorded in
caches, and real builds + runs of both Debian-based variants (``scripts/container_image.sh build
cpu|cuda``, podman, debootstrap'd Debian base): ``check_image.py`` inside the CUDA image (torch's
CUDA build, fla, Triton's C build; the GPU checks reported as not run), then the tiny workflow in
each image through Snakemake's own container support (``--sdm apptainer``) with the podman
stand-in ``containers/podman-apptainer/apptainer`` (``--network none``, CPU). Its completions,
caches and tau must equal the local run's.

The builds need root, podman and debootstrap (``scripts/container_image.sh install``), a Debian
mirror (debootstrap; apt in the CUDA build) and, for the CUDA image's first build, PyPI (~3 GB of
wheels, then cached under ``~/.cache/dflash-eval``). Without them the build+run tests are skipped
with the reason; with ``DFLASH_EVAL_REQUIRE_CONTAINER=1`` (set by ``.ci/run``) they fail instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import yaml

from run_compare import assert_runs_match
from test_workflow import REPO, make_tiny_workdir, smk

DOCKERFILE = (REPO / "containers" / "cuda" / "Dockerfile").read_text()
CHECK = REPO / "containers" / "cuda" / "check_image.py"
SCRIPT = REPO / "scripts" / "container_image.sh"
SHIM_DIR = REPO / "containers" / "podman-apptainer"
TAG = "localhost/dflash-eval-cpu:test"
CUDA_TAG = "localhost/dflash-eval-cuda:test"
#: modules of the package check_image.py must import (all but the package itself and __main__)
N_MODULES = len([p for p in (REPO / "dflash_eval").rglob("*.py")
                 if p.name != "__main__.py" and p != REPO / "dflash_eval" / "__init__.py"
                 and p != REPO / "dflash_eval" / "serving" / "vllm" / "connector.py"])  # imported by vLLM's own venv only


# --------------------------------------------------------------------------- recipes


def test_dockerfile_base_and_torch_agree():
    """Fully qualified base; torch 2.13.0's default wheel requires cuda-toolkit 13.0.x (its
    package metadata), so the CUDA base is 13.0."""
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE, re.M).group(1)
    assert base.startswith("docker.io/nvidia/cuda:13.0."), base
    assert "ARG TORCH_VERSION=2.13.0" in DOCKERFILE
    assert re.search(r"^ARG CAUSAL_CONV1D_VERSION=$", DOCKERFILE, re.M)  # absent unless asked for
    assert "CAUSAL_CONV1D_FORCE_BUILD=TRUE" in DOCKERFILE  # never the setup's GitHub download
    assert "check_image.py" in DOCKERFILE and "FLA_FLASH_QLA=0" in DOCKERFILE
    for line in re.findall(r"^FROM (\S+)", DOCKERFILE, re.M):
        assert line == "${BASE_IMAGE}", line


def test_apptainer_definition_builds_from_an_archive():
    text = (REPO / "containers" / "dflash-eval.def").read_text()
    header = dict(re.findall(r"^(Bootstrap|From):\s*(\S+)", text, re.M))
    assert header["Bootstrap"] == "docker-archive", header  # no Docker daemon needed
    assert header["From"].endswith(".tar"), header


def test_default_image_is_an_explicit_local_sif():
    schema = yaml.safe_load((REPO / "dflash_eval" / "schemas" / "config.schema.yaml").read_text())
    default = schema["properties"]["containers"]["properties"]["cuda"]["default"]
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())["containers"]["cuda"]
    assert default == config == "containers/dflash-eval-cuda_0.1.0.sif"
    assert "containers/dflash-eval-cuda_0.1.0.sif" in (REPO / "containers" / "README.md").read_text()


@pytest.mark.parametrize("case, expected", [
    ("missing", "absent"),
    ("broken", "import failed: ImportError: libcudart.so.13: cannot open shared object file"),
    ("working", "imported present (no distribution metadata)"),
])
def test_causal_conv1d_status(tmp_path, monkeypatch, case, expected):
    """The cache records whether causal-conv1d's kernels import, not only that it is installed."""
    from dflash_eval.target.hybrid import causal_conv1d_status

    for name in ("causal_conv1d", "causal_conv1d_cuda"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    if case != "missing":
        pkg = tmp_path / "causal_conv1d"
        pkg.mkdir()
        (pkg / "__init__.py").write_text("import causal_conv1d_cuda\n")
        body = ("raise ImportError('libcudart.so.13: cannot open shared object file')\n"
                if case == "broken" else "def causal_conv1d_fwd(*a):\n    pass\n")
        (tmp_path / "causal_conv1d_cuda.py").write_text(body)
        monkeypatch.syspath_prepend(str(tmp_path))
    else:
        import importlib.util

        if importlib.util.find_spec("causal_conv1d") is not None:
            pytest.skip("causal_conv1d is installed here")
    assert causal_conv1d_status() == expected


@pytest.mark.container
def test_check_image_fails_loudly(tmp_path):
    """The image's import check exits 1 and names what is wrong (here: a CPU torch in the CUDA
    variant, and fla missing)."""
    proc = subprocess.run([sys.executable, str(CHECK), "cuda"],
                          capture_output=True, text=True, env={**os.environ, "CUDA_VERSION": "13.0.2"})
    if '"torch_cuda": "None"' not in proc.stdout:
        pytest.skip("this environment has a CUDA torch")
    assert proc.returncode == 1
    failed = [line for line in proc.stderr.splitlines() if line.startswith("check_image: FAILED: ")]
    assert "check_image: FAILED: torch is a CPU build in the CUDA variant" in failed
    assert "check_image: FAILED: flash-linear-attention is not installed" in failed
    assert "check_image: FAILED: fla-core is not installed" in failed
    assert json.loads(proc.stdout.splitlines()[0])["dflash_eval_modules"] == N_MODULES
    cpu = subprocess.run([sys.executable, str(CHECK), "cpu"], capture_output=True, text=True)
    assert cpu.returncode == 0, cpu.stderr


def _check_image_module():
    spec = importlib.util.spec_from_file_location("check_image", CHECK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("torch_cuda, base, wheel, expected", [
    ("13.0", "13.0.2", "13.0.96", []),   # NVIDIA's base + PyPI's torch
    ("13.0", "", "13.0.96", []),         # Debian base: the runtime wheel is the only CUDA
    (None, "", None, ["torch is a CPU build in the CUDA variant"]),
    ("13.0", "12.8.1", "13.0.96",
     ["torch is built for CUDA 13.0 but the base image (CUDA_VERSION) has CUDA 12.8.1: use CUDA 13.x there"]),
    ("12.8", "", "13.0.96",
     ["torch is built for CUDA 12.8 but the nvidia-cuda-runtime wheel has CUDA 13.0.96: use CUDA 12.x there"]),
    ("13.0", "", None, ["no CUDA runtime: neither an NVIDIA base (CUDA_VERSION) nor PyPI's nvidia-cuda-runtime wheel"]),
])
def test_check_image_cuda_majors(torch_cuda, base, wheel, expected):
    assert _check_image_module().cuda_major_problems(torch_cuda, base, wheel) == expected


def test_check_image_says_what_needs_a_gpu():
    """Without a CUDA device the GPU checks are reported as not run (never silently skipped), and
    --require-gpu turns that into a failure."""
    mod = _check_image_module()
    found, problems, notes = {}, [], []
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    mod.check_gpu(found, problems, notes)
    assert found == {"gpu": "none visible"} and problems == []
    assert notes == [f"{mod.GPU_CHECKS} (no CUDA device visible: torch.cuda.is_available() is False; "
                     "on a GPU host run it with apptainer exec --nv)"]


def test_dockerfile_debian_cuda_variant():
    """One Dockerfile: WHEELHOUSE=cuda installs offline from the wheelhouse subfolder, adds what
    Triton compiles with, and refuses causal-conv1d (no nvcc there)."""
    assert re.search(r"^ARG WHEELHOUSE=$", DOCKERFILE, re.M)
    assert 'want="python3 python3-venv python3-dev gcc libc6-dev"' in DOCKERFILE
    assert 'export PIP_NO_INDEX=1 PIP_FIND_LINKS="/wheelhouse/$wh"' in DOCKERFILE
    assert "build on NVIDIA's base (WHEELHOUSE empty)" in DOCKERFILE
    script = SCRIPT.read_text()
    assert "TORCH_REQUIREMENT:-torch===$TORCH_VERSION" in script  # never a local +cpu build
    assert re.search(r"^TORCH_VERSION=2\.13\.0$", script, re.M)
    # a RUN reading IMAGE before the ENV: buildah caches ENV on its unexpanded text (a new tag kept the old one)
    assert re.search(r'^RUN echo "\$IMAGE" > /opt/dflash-eval/IMAGE\nENV DFLASH_EVAL_IMAGE=\$\{IMAGE\}$',
                     DOCKERFILE, re.M)
    ignored = (REPO / ".gitignore").read_text().splitlines()
    assert "/containers/cuda/wheelhouse/*/" in ignored and "/containers/cuda/wheelhouse/*.whl" in ignored


# --------------------------------------------------------------------------- build and run


def _unavailable(reason: str):
    if os.environ.get("DFLASH_EVAL_REQUIRE_CONTAINER") == "1":
        pytest.fail(f"container build required (DFLASH_EVAL_REQUIRE_CONTAINER=1) but: {reason}")
    pytest.skip(f"container build unavailable: {reason}")


def _build(variant: str, tag: str, tmp_path_factory) -> tuple[str, dict]:
    """Build ``variant`` with scripts/container_image.sh; returns (tag, environment for Snakemake:
    PATH with the podman stand-in first, CONTAINERS_CONF where this host needs it)."""
    if not shutil.which("podman"):
        _unavailable("podman not installed (as root: scripts/container_image.sh install)")
    has_base = subprocess.run(["podman", "image", "exists", "localhost/dflash-eval-base:bookworm"]).returncode == 0
    if not has_base and (not shutil.which("debootstrap") or os.geteuid() != 0):
        _unavailable("no base image and no debootstrap as root to make one (scripts/container_image.sh install)")
    log = tmp_path_factory.mktemp(f"image-{variant}") / "build.log"
    with open(log, "w") as fh:
        proc = subprocess.run(["bash", str(SCRIPT), "build", variant, tag], stdout=fh, stderr=subprocess.STDOUT,
                              timeout=3600)
    text = log.read_text()
    if proc.returncode != 0:
        pytest.fail(f"scripts/container_image.sh build {variant} failed:\n{text[-5000:]}")
    print("\n".join(line for line in text.splitlines() if line.startswith("container_image: ")))
    # the image names itself by this tag, also when podman's layer cache had the content under another
    inspect = subprocess.run(["podman", "image", "inspect", "--format", "{{json .Config.Env}}", tag],
                             capture_output=True, text=True, check=True)
    assert f"DFLASH_EVAL_IMAGE={tag}" in json.loads(inspect.stdout), inspect.stdout
    env_lines = subprocess.run(["bash", str(SCRIPT), "env"], capture_output=True, text=True, check=True).stdout
    env = {**os.environ, "PATH": f"{SHIM_DIR}{os.pathsep}{os.environ['PATH']}"}
    for m in re.finditer(r"^export (\w+)=(\S+)$", env_lines, re.M):
        env[m.group(1)] = m.group(2)
    return tag, env


@pytest.fixture(scope="module")
def cpu_image(tmp_path_factory):
    """The CPU image (scripts/container_image.sh build cpu)."""
    return _build("cpu", TAG, tmp_path_factory)


@pytest.fixture(scope="module")
def cuda_image(tmp_path_factory):
    """The Debian-based CUDA image (scripts/container_image.sh build cuda): PyPI's CUDA torch."""
    return _build("cuda", CUDA_TAG, tmp_path_factory)


def _run_tiny_in_image(tag: str, env: dict, tiny_run, tmp_path, torch_version: str) -> None:
    """`--sdm apptainer` with the podman stand-in: every stage runs in the image without network
    and gives the local run's completions, caches and tau; the cache names the image and records
    that causal-conv1d is absent (torch conv fallback)."""
    import h5py

    wd = make_tiny_workdir(tmp_path / "wf", containers={"cuda": tag},
                           prompt_sets={"set_a": {"source": "file", "path": "prompts/a.jsonl"}},
                           checkpoints={"glob": "ckpts/step100.pt", "demo": []})
    # The jobs use the image's own copy of the package: the working directory is a copy of the
    # workflow without dflash_eval/, and the checkout is not mounted.
    assert not (wd / "dflash_eval").exists()
    proc = smk(wd, "--workflow-profile", str(REPO / "profiles" / "ci"), "--sdm", "apptainer", env=env, timeout=1800)
    out = proc.stdout + proc.stderr
    assert re.search(r"\b(\d+) of \1 steps \(100%\) done", out), out[-3000:]  # every planned job ran
    with h5py.File(wd / "results" / "tiny" / "cache" / "set_a.h5", "r") as f:
        assert f.attrs["image"] == tag
        assert f.attrs["causal_conv1d_kernel"] == "absent" and f.attrs["causal_conv1d_version"] == "absent"
        assert f.attrs["torch_version"] == torch_version
    assert_runs_match(tiny_run, wd, "tiny", checkpoints=["step100"], prompt_sets=["set_a"])
    return wd


@pytest.mark.slow
@pytest.mark.container
def test_cpu_image_runs_tiny_workflow(cpu_image, tiny_run, tmp_path):
    tag, env = cpu_image
    wd = _run_tiny_in_image(tag, env, tiny_run, tmp_path, "2.13.0+cpu")

    # The stand-in runs jobs exactly like that: no network inside.
    probe = textwrap.dedent("""
        import socket
        try:
            socket.create_connection(("deb.debian.org", 80), timeout=5)
        except OSError as err:
            print("offline:", type(err).__name__)
        else:
            print("online")
    """)
    proc = subprocess.run(["apptainer", "exec", "--home", str(wd), tag, "python", "-c", probe],
                          cwd=wd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.stdout.startswith("offline:"), proc.stdout + proc.stderr


@pytest.mark.container
def test_cuda_image_check(cuda_image):
    """check_image.py in the Debian-based CUDA image, as a job would run (no GPU here): torch is
    PyPI's CUDA 13 build and the nvidia-cuda-runtime wheel agrees; fla and fla-core at the pins with
    Triton kernels, bound by transformers; Triton's C build works; the GPU checks say they did not
    run, and --require-gpu fails."""
    tag, env = cuda_image
    cmd = ["podman", "run", "--rm", "--network", "none", tag, "python", "/opt/dflash-eval/check_image.py", "cuda"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = json.loads(proc.stdout.splitlines()[0])
    req = (REPO / "containers" / "cuda" / "requirements-cuda.txt").read_text()
    pins = dict(line.split("==") for line in req.split() if "==" in line)
    assert found["flash-linear-attention"] == pins["flash-linear-attention"] and found["fla-core"] == pins["fla-core"]
    assert found["torch"] == "2.13.0" and found["torch_cuda"].startswith("13.")
    assert found["runtime_wheel"].startswith("nvidia-cuda-runtime 13.") and found["base_cuda"] == ""
    assert found["fla_triton_kernels"] > 0 and found["triton_cc"] == "ok" and found["cudnn"].startswith("9")
    assert found["transformers_chunk_rule"].startswith("fla.ops.gated_delta_rule."), found
    assert found["gpu"] == "none visible" and found["causal_conv1d_kernel"] == "absent"
    assert found["dflash_eval_modules"] == N_MODULES
    assert "check_image: NOT RUN (needs a GPU): " in proc.stdout
    proc = subprocess.run(cmd + ["--require-gpu"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "check_image: FAILED: --require-gpu: no CUDA device is visible" in proc.stderr


@pytest.mark.slow
@pytest.mark.container
def test_cuda_image_runs_tiny_workflow(cuda_image, tiny_run, tmp_path):
    """The tiny workflow in the CUDA image on the CPU (PyPI's CUDA torch, no GPU): the local run's
    numbers."""
    tag, env = cuda_image
    _run_tiny_in_image(tag, env, tiny_run, tmp_path, "2.13.0+cu130")
