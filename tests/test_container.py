"""The dflash-eval image (containers/cuda/Dockerfile).

Static checks of the recipes, the causal-conv1d status recorded in caches, and a real build +
run: the CPU variant built with podman, offline, on a debootstrap'd Debian base
(``scripts/container_cpu_image.sh build``), then the tiny workflow run in it through Snakemake's
own container support (``--sdm apptainer``) with the podman stand-in
``containers/podman-apptainer/apptainer`` (``--network none``). Its completions, caches and tau
must equal the local run's.

The build needs root, podman and debootstrap (``scripts/container_cpu_image.sh install``) and a
Debian mirror for debootstrap (the base image is kept in podman's storage and reused). Without
them the build+run test is skipped with the reason; with ``DFLASH_EVAL_REQUIRE_CONTAINER=1`` (set
by ``.ci/run``) it fails instead.
"""

from __future__ import annotations

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
SCRIPT = REPO / "scripts" / "container_cpu_image.sh"
SHIM_DIR = REPO / "containers" / "podman-apptainer"
TAG = "localhost/dflash-eval-cpu:test"


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
    from dflash_eval.hybrid import causal_conv1d_status

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
    proc = subprocess.run([sys.executable, str(REPO / "containers" / "cuda" / "check_image.py"), "cuda"],
                          capture_output=True, text=True, env={**os.environ, "CUDA_VERSION": "13.0.2"})
    if "fla" in proc.stdout and '"torch_cuda": "None"' not in proc.stdout:
        pytest.skip("this environment has a CUDA torch and fla")
    assert proc.returncode == 1
    assert "check_image: FAILED: import fla" in proc.stderr
    assert "is a CPU build in the CUDA variant" in proc.stderr


# --------------------------------------------------------------------------- build and run


def _unavailable(reason: str):
    if os.environ.get("DFLASH_EVAL_REQUIRE_CONTAINER") == "1":
        pytest.fail(f"container build required (DFLASH_EVAL_REQUIRE_CONTAINER=1) but: {reason}")
    pytest.skip(f"container build unavailable: {reason}")


@pytest.fixture(scope="module")
def cpu_image(tmp_path_factory):
    """The CPU image built by scripts/container_cpu_image.sh; yields (tag, environment for
    Snakemake: PATH with the podman stand-in first, CONTAINERS_CONF where this host needs it)."""
    if not shutil.which("podman"):
        _unavailable("podman not installed (as root: scripts/container_cpu_image.sh install)")
    has_base = subprocess.run(["podman", "image", "exists", "localhost/dflash-eval-base:bookworm"]).returncode == 0
    if not has_base and (not shutil.which("debootstrap") or os.geteuid() != 0):
        _unavailable("no base image and no debootstrap as root to make one (scripts/container_cpu_image.sh install)")
    log = tmp_path_factory.mktemp("image") / "build.log"
    with open(log, "w") as fh:
        proc = subprocess.run(["bash", str(SCRIPT), "build", TAG], stdout=fh, stderr=subprocess.STDOUT, timeout=2400)
    if proc.returncode != 0:
        pytest.fail(f"scripts/container_cpu_image.sh build failed:\n{log.read_text()[-5000:]}")
    env_lines = subprocess.run(["bash", str(SCRIPT), "env"], capture_output=True, text=True, check=True).stdout
    env = {**os.environ, "PATH": f"{SHIM_DIR}{os.pathsep}{os.environ['PATH']}"}
    for m in re.finditer(r"^export (\w+)=(\S+)$", env_lines, re.M):
        env[m.group(1)] = m.group(2)
    return TAG, env


@pytest.mark.slow
@pytest.mark.container
def test_cpu_image_runs_tiny_workflow(cpu_image, tiny_run, tmp_path):
    """`--sdm apptainer` with the podman stand-in: every stage runs in the image without network
    and gives the local run's completions, caches and tau; the cache names the image and records
    that causal-conv1d is absent (torch conv fallback)."""
    import h5py

    tag, env = cpu_image
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
        assert f.attrs["torch_version"] == "2.13.0+cpu"
    assert_runs_match(tiny_run, wd, "tiny", checkpoints=["step100"], prompt_sets=["set_a"])

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
