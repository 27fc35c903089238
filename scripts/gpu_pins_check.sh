#!/usr/bin/env bash
# The image's pins on a GPU host outside the container, where that host cannot reach a package
# index and carries at most a few tens of MB: torch, triton and the large libraries are the
# host's own; fla-core / flash-linear-attention, this package and the small pins the host lacks
# travel as wheels. Then check_image.py's GPU checks and the tiny workflows on CUDA, whose tau
# is compared with the CPU image's run of the same inputs.
#
#   scripts/gpu_pins_check.sh prepare [DIR]   # here: wheels, tiny inputs, the CPU image's runs
#   scripts/gpu_pins_check.sh run [DIR]       # on the GPU host (DIR travels with the checkout)
#   SMOKE=1 ...                               # both steps on this CPU machine (checks the script):
#                                             # GPU_PYTHON = this Python, PYTHON=.venv/bin/python,
#                                             # check_image.py cpu, every job on the CPU
#
# DIR: default .gpucheck (git-ignored). prepare needs the dev venv (make venv), network for pip,
# and the CPU image (scripts/container_image.sh build cpu; tag $CPU_IMAGE, default
# localhost/dflash-eval-cpu:0.1.0) with podman; it writes
#   DIR/wheels/      fla-core, flash-linear-attention (containers/cuda/requirements-cuda.txt),
#                    dflash-eval (this checkout), and the pins' dependencies in $CARRY_TOPS
#                    (default: snakemake jsonschema gguf tenacity, at the versions of .venv)
#                    minus what a CUDA PyTorch host has ($HOST_HAS) and minus pulp (16 MB;
#                    Snakemake imports it only for its ILP scheduler and falls back without),
#                    for CPython $GPU_PYTHON (default 3.12) on manylinux x86_64;
#   DIR/llama, DIR/hybrid   inputs of the tiny workflows (scripts/gpu_pins_tiny.py make);
#   DIR/<set>/cpu-image/    tau.csv, completions/ and eval/ of the CPU image's run (podman
#                           stand-in for apptainer, --network none).
# run installs DIR/wheels with `pip install --no-index --no-deps --target`, prints each pin next
# to the version used, runs containers/cuda/check_image.py cuda --require-gpu (fla's Triton chunk
# rule against its torch recurrence on the GPU; the data wheels are not carried), runs both tiny
# workflows with every torch job on CUDA (float32; the hybrid one with linear_attn_backend fla and
# kernel_parity on) and prints scripts/gpu_pins_tiny.py compare for each. Results go to $OUT (or
# /tmp/dflash-gpucheck/out).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
cmd=${1:-}
DIR=$(cd "$REPO" && mkdir -p "${2:-.gpucheck}" && cd "${2:-.gpucheck}" && pwd)
SMOKE=${SMOKE:-0}
GPU_PYTHON=${GPU_PYTHON:-3.12}
[ "$SMOKE" = 0 ] || GPU_PYTHON=$("${VENV_PY:-$REPO/.venv/bin/python}" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
CPU_IMAGE=${CPU_IMAGE:-localhost/dflash-eval-cpu:0.1.0}
CARRY_TOPS=${CARRY_TOPS:-snakemake jsonschema gguf tenacity}
# What a CUDA PyTorch host provides (and what is too large to carry): torch and its CUDA wheels,
# and the scientific stack whose versions `run` prints next to the pins.
HOST_HAS=${HOST_HAS:-torch triton numpy pandas pyarrow h5py matplotlib transformers tokenizers safetensors \
huggingface-hub hf-xet accelerate pyyaml tqdm httpx httpcore anyio h11 idna certifi requests urllib3 \
charset-normalizer jinja2 markupsafe packaging psutil pillow fonttools kiwisolver contourpy cycler \
pyparsing python-dateutil six regex filelock fsspec typing-extensions attrs tabulate wrapt click rich \
markdown-it-py mdurl pygments typer shellingham setuptools einops pulp}
VENV_PY=${VENV_PY:-$REPO/.venv/bin/python}
say() { echo "gpu_pins_check: $*" >&2; }
die() { say "$*"; exit 1; }

prepare() {
    [ -x "$VENV_PY" ] || die "no dev venv ($VENV_PY): make venv"
    rm -rf "$DIR/wheels" "$DIR/llama" "$DIR/hybrid"
    mkdir -p "$DIR/wheels"
    local pins
    pins=$("$VENV_PY" - "$HOST_HAS" $CARRY_TOPS <<'EOF'
import importlib.metadata as md, re, sys
from packaging.requirements import Requirement
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
skip = {norm(n) for n in sys.argv[1].split()}
seen = {}
def walk(name):
    n = norm(name)
    if n in seen or n in skip:
        return
    seen[n] = md.version(name)
    for r in md.distribution(name).requires or []:
        req = Requirement(r)
        if not req.marker or req.marker.evaluate({"extra": ""}):
            walk(req.name)
for top in sys.argv[2:]:
    walk(top)
print("\n".join(f"{n}=={v}" for n, v in sorted(seen.items())))
EOF
)
    pins="$pins
$(grep -E '^[A-Za-z0-9_.-]+==' "$REPO/containers/cuda/requirements-cuda.txt")"
    say "wheels for CPython $GPU_PYTHON -> $DIR/wheels: $(echo $pins)"
    local plat=(--only-binary=:all: --python-version "$GPU_PYTHON" --implementation cp --platform manylinux_2_28_x86_64
                --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
                --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
    for p in $pins; do
        "$VENV_PY" -m pip download -q --no-deps "${plat[@]}" -d "$DIR/wheels" "$p" 2>/dev/null \
            || "$VENV_PY" -m pip wheel -q --no-deps -w "$DIR/wheels" "$p"   # sdist only: pure Python
    done
    local src
    src=$(mktemp -d)  # a copy: setuptools would leave build/ in the checkout, which travels too
    cp -r "$REPO/pyproject.toml" "$REPO/README.md" "$REPO/dflash_eval" "$src/"
    "$VENV_PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DIR/wheels" "$src"
    rm -rf "$src"
    local bad
    bad=$(cd "$DIR/wheels" && ls *.whl | grep -v -E -- "-(py3|py2.py3|cp${GPU_PYTHON/./}|cp3[0-9]*-abi3)-" || true)
    [ -z "$bad" ] || die "wheels not for CPython $GPU_PYTHON: $bad"

    (cd "$REPO" && "$VENV_PY" scripts/gpu_pins_tiny.py make "$DIR")
    podman image exists "$CPU_IMAGE" || die "no CPU image $CPU_IMAGE (scripts/container_image.sh build cpu)"
    eval "$(bash "$REPO/scripts/container_image.sh" env)"
    local set wd
    for set in llama hybrid; do
        wd=$(mktemp -d "${TMPDIR:-/tmp}/dflash-gpucheck-$set.XXXXXX")
        workdir "$set" "$wd"
        say "$set: the tiny workflow in the CPU image $CPU_IMAGE"
        (cd "$wd" && PATH="$REPO/containers/podman-apptainer:$PATH" "$REPO/.venv/bin/snakemake" \
            --workflow-profile "$REPO/profiles/ci" --sdm apptainer --config "containers={cuda: $CPU_IMAGE}" \
            > "$wd/snakemake.log" 2>&1) || { tail -n 40 "$wd/snakemake.log" >&2; die "$set: CPU image run failed ($wd)"; }
        keep_results "$wd" "$DIR/$set/cpu-image"
        rm -rf "$wd"
    done
    say "ready: $(du -sh "$DIR" | cut -f1) in $DIR (the device tool carries at most 64 MiB with the checkout)"
}

workdir() {  # workdir SET WD: the workflow from this checkout + SET's inputs (no dflash_eval/: the wheel is used)
    local set=$1 wd=$2
    mkdir -p "$wd"
    cp "$REPO/Snakefile" "$wd/"
    cp -rL "$REPO/rules" "$REPO/config" "$REPO/envs" "$REPO/report" "$wd/"   # -L: config/schemas is a link
    ln -sfn "$REPO/demo" "$wd/demo"
    cp -r "$DIR/$set/tiny_target" "$DIR/$set/prompts" "$DIR/$set/ckpts" "$wd/"
    cp "$DIR/$set/config/config.yaml" "$wd/config/config.yaml"
}

keep_results() {  # keep_results WD DST: the small result files of WD's run
    local run
    run=$(ls -d "$1"/results/*/ | head -1)
    mkdir -p "$2"
    cp "$run/tau.csv" "$2/"
    cp -r "$run/completions" "$run/eval" "$run/cache" "$2/"
    rm -f "$2"/cache/*.partial
    [ ! -f "$run/kernel_parity.json" ] || cp "$run/kernel_parity.json" "$2/"
}

run() {
    [ -d "$DIR/wheels" ] || die "no $DIR/wheels: run '$0 prepare' on a machine with a package index first"
    local top=${GPUCHECK_TMP:-/tmp/dflash-gpucheck} py=${PYTHON:-python3} variant=cuda flags=(--require-gpu) device=cuda
    [ "$SMOKE" = 0 ] || { variant=cpu; flags=(); device=cpu; }
    local status=0
    local site=$top/site out=${OUT:-$top/out}
    rm -rf "$top" && mkdir -p "$site" "$out"
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$DIR"/wheels/*.whl
    export PYTHONPATH="$site" PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0 HF_HUB_OFFLINE=1
    if [ "$SMOKE" != 0 ]; then  # as on the GPU host, where pulp is not carried
        mkdir -p "$top/no-pulp"
        echo 'raise ImportError("pulp is not carried (scripts/gpu_pins_check.sh)")' > "$top/no-pulp/pulp.py"
        PYTHONPATH="$site:$top/no-pulp"
    fi
    { "$py" - "$REPO" <<'EOF'
import importlib.metadata as md, pathlib, platform, sys
repo = pathlib.Path(sys.argv[1])
print(f"python {platform.python_version()}")
for f in ("containers/cuda/requirements.txt", "containers/cuda/requirements-cuda.txt"):
    for line in (repo / f).read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, pin = line.split("#")[0].strip().split("==")
            try:
                got = md.version(name)
            except md.PackageNotFoundError:
                got = "absent"
            print(f"{name:24s} pin {pin:10s} used {got}{'' if got == pin else '   <- differs'}")
import torch
print(f"torch {torch.__version__} (the host's; the image pins 2.13.0), CUDA {torch.version.cuda}, "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU visible'}")
EOF
      echo "== check_image.py $variant ${flags[*]} --no-data-wheels"
      "$py" "$REPO/containers/cuda/check_image.py" "$variant" "${flags[@]}" --no-data-wheels 2>&1 \
          && echo "check_image: passed"
    } | tee "$out/check_image.txt" || status=1
    local set wd
    for set in llama hybrid; do
        wd=$top/$set
        workdir "$set" "$wd"
        "$py" "$REPO/scripts/gpu_pins_tiny.py" gpu-config "$set" "$wd/gpu.yaml" "$device"
        say "$set: the tiny workflow on $device"
        if ! (cd "$wd" && "$py" -m snakemake --cores "${CORES:-all}" --resources gpu=1 --show-failed-logs \
                --configfile config/config.yaml gpu.yaml > "$wd/snakemake.log" 2>&1); then
            tail -n 60 "$wd/snakemake.log" | tee -a "$out/compare.txt"
            say "$set: GPU run failed"; status=1; continue
        fi
        { echo "== $set: the CPU image's run vs this GPU run"
          "$py" "$REPO/scripts/gpu_pins_tiny.py" compare "$DIR/$set/cpu-image" "$(ls -d "$wd"/results/*/ | head -1)"
        } | tee -a "$out/compare.txt" || status=1
    done
    # $OUT brings back a few files only: the results of both runs in one archive
    (cd "$top" && tar czf "$out/gpucheck-results.tgz" llama/results hybrid/results llama/snakemake.log \
        hybrid/snakemake.log 2>/dev/null) || true
    return $status
}

case "$cmd" in
    prepare) prepare ;;
    run) run ;;
    *) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
