#!/usr/bin/env bash
# Build the dflash-eval image (containers/cuda/Dockerfile) with podman on a Debian base made by
# debootstrap: no container registry needed, pip only from a local wheelhouse in the build.
#
#   scripts/container_image.sh build cpu|cuda [TAG]  # default TAG localhost/dflash-eval-VARIANT:0.1.0
#   scripts/container_image.sh wheels cpu|cuda       # only fill the wheelhouse (step 2)
#   eval "$(scripts/container_image.sh env)"         # CONTAINERS_CONF where this host needs one (below)
#   scripts/container_image.sh install               # apt-get podman debootstrap runc (root) if missing
#
# build:
#   1. base image $BASE_TAG (default localhost/dflash-eval-base:bookworm), the same for both
#      variants: reused when podman has it, else `debootstrap --variant=minbase bookworm` with
#      python3 + python3-venv from $DEBIAN_MIRROR (default http://deb.debian.org/debian),
#      imported with `podman import`.
#   2. the wheelhouse, made with the host's pip ($PYTHON, default python3, whose major.minor must
#      equal the base's python3): torch, containers/cuda/requirements.txt and
#      envs/requirements-nodeps.txt, and for cuda containers/cuda/requirements-cuda.txt (fla).
#      cpu: `pip wheel` into containers/cuda/wheelhouse/; it must resolve torch to the CPU build
#        (PIP_FIND_LINKS=<folder with torch-2.13.0+cpu-*.whl> or
#        PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu); a CUDA torch is refused.
#      cuda: PyPI's CUDA build of torch ($TORCH_REQUIREMENT, default torch===2.13.0: exactly that
#        version, never a local +cpu build) with the nvidia-* / cuda-toolkit / triton wheels it
#        requires (~3.5 GB). Downloaded once into $DFLASH_EVAL_WHEEL_CACHE (default
#        ~/.cache/dflash-eval) / wheels-cuda-<hash of the pins and the Python>, hard-linked into
#        containers/cuda/wheelhouse/cuda/; a CPU torch is refused. Other wheels-cuda-* folders
#        there (older pins) are deleted once a new one is complete.
#   3. `podman build` with the wheelhouse bind-mounted (no layer keeps the wheels): cpu with
#      --network none; cuda with the network only for apt (python3-dev, gcc, libc6-dev from the
#      base's Debian mirror: Triton compiles a C launcher at run time), pip offline
#      (PIP_NO_INDEX). The image's last step runs containers/cuda/check_image.py.
#
# env: podman's defaults fail in some sandboxes (seen: a VM with cgroup v1+v2 "hybrid" mounts and
# no CAP_SYS_RESOURCE: crun refuses hybrid cgroups, and the default ulimits nofile=1048576 /
# nproc=4194304 exceed the hard limits). `env` runs a probe container; where it fails it writes
# a containers.conf (runtime runc, ulimits at this host's hard limits) and prints
# `export CONTAINERS_CONF=...`, which build uses too. Prints nothing where podman works as is.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
BASE_TAG=${BASE_TAG:-localhost/dflash-eval-base:bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
TORCH_REQUIREMENT=${TORCH_REQUIREMENT:-torch===$TORCH_VERSION}
WHEELHOUSE="$REPO/containers/cuda/wheelhouse"
WHEEL_CACHE=${DFLASH_EVAL_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dflash-eval}
CONF_DIR=${DFLASH_EVAL_PODMAN_CONF_DIR:-${TMPDIR:-/tmp}/dflash-eval-podman}

say() { echo "container_image: $*" >&2; }
die() { say "$*"; exit 1; }

cmd_install() {
    local missing=()
    command -v podman >/dev/null || missing+=(podman)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    command -v runc >/dev/null || missing+=(runc)
    [ ${#missing[@]} -eq 0 ] && { say "podman, debootstrap and runc already installed"; return 0; }
    [ "$(id -u)" = 0 ] || die "missing: ${missing[*]}; installing needs root"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    say "installed ${missing[*]}"
}

probe() {  # probe IMAGE: does a container start here with the current podman settings?
    podman run --rm --network none "$1" true >/dev/null 2>&1
}

# Sets CONTAINERS_CONF when podman's defaults do not work on this host; echoes the export line.
podman_env() {
    local image=$1
    probe "$image" && return 0
    command -v runc >/dev/null || die "podman cannot start a container here and runc is not installed ($0 install)"
    local nofile nproc
    nofile=$(ulimit -Hn); [ "$nofile" = unlimited ] && nofile=1048576
    # podman caps its own process limit at 32768 here; a container cannot get more than podman has
    nproc=$(ulimit -Hu); { [ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ]; } && nproc=32768
    mkdir -p "$CONF_DIR"
    cat > "$CONF_DIR/containers.conf" <<EOF
# Written by scripts/container_image.sh: podman settings for a host where the defaults fail.
[containers]
default_ulimits = ["nofile=${nofile}:${nofile}", "nproc=${nproc}:${nproc}"]
[engine]
runtime = "runc"
EOF
    export CONTAINERS_CONF="$CONF_DIR/containers.conf"
    probe "$image" || die "podman cannot start a container here, even with $CONTAINERS_CONF: $(podman run --rm --network none "$image" true 2>&1 | tail -1)"
    echo "export CONTAINERS_CONF=$CONTAINERS_CONF"
}

make_base() {
    if podman image exists "$BASE_TAG"; then
        say "base image $BASE_TAG: present (reused)"
        return 0
    fi
    command -v debootstrap >/dev/null || die "debootstrap not installed ($0 install)"
    [ "$(id -u)" = 0 ] || die "debootstrap needs root"
    local root
    root=$(mktemp -d "${TMPDIR:-/tmp}/dflash-eval-rootfs.XXXXXX")
    say "debootstrap bookworm (minbase + python3, python3-venv) from $DEBIAN_MIRROR"
    if ! debootstrap --variant=minbase --include=python3,python3-venv bookworm "$root" "$DEBIAN_MIRROR" \
            > "$root.log" 2>&1; then
        tail -n 20 "$root.log" >&2
        rm -rf "$root"
        die "debootstrap failed (log above)"
    fi
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | podman import --message "debootstrap bookworm minbase + python3" - "$BASE_TAG" >/dev/null
    rm -rf "$root" "$root.log"
    say "base image $BASE_TAG: imported"
}

# torch_is_cuda WHEEL: exit 0 when the wheel's metadata requires CUDA wheels (nvidia-* / cuda-toolkit)
torch_is_cuda() {
    "$PYTHON" - "$1" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    cuda = [l for l in z.read(meta).decode().splitlines()
            if l.startswith("Requires-Dist:") and ("nvidia-" in l or "cuda-toolkit" in l)]
sys.exit(0 if cuda else 1)
EOF
}

check_python() {  # the wheels are for the host's Python: it must be the base's
    local host_py base_py
    host_py=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    base_py=$(podman run --rm --network none "$BASE_TAG" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [ "$host_py" = "$base_py" ] || die "host $PYTHON is Python $host_py but the base image has $base_py: \
wheels would not match (PYTHON=python$base_py $0 build ...)"
    echo "$host_py"
}

wheels_cpu() {
    local py=$1 torch_whl
    mkdir -p "$WHEELHOUSE"
    say "pip wheel -> containers/cuda/wheelhouse (Python $py)"
    "$PYTHON" -m pip wheel -q --wheel-dir "$WHEELHOUSE" "torch==$TORCH_VERSION" -r "$REPO/containers/cuda/requirements.txt"
    "$PYTHON" -m pip wheel -q --no-deps --wheel-dir "$WHEELHOUSE" -r "$REPO/envs/requirements-nodeps.txt"
    torch_whl=$(ls "$WHEELHOUSE"/torch-"$TORCH_VERSION"*.whl | head -1)
    if torch_is_cuda "$torch_whl"; then
        rm -f "$torch_whl"
        die "pip resolved torch==$TORCH_VERSION to a CUDA build ($(basename "$torch_whl")). Give it the CPU \
wheel: PIP_FIND_LINKS=<folder with torch-$TORCH_VERSION+cpu-*.whl> or \
PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu"
    fi
    say "wheelhouse: $(ls "$WHEELHOUSE"/*.whl | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1), torch: $(basename "$torch_whl")"
}

wheels_cuda() {
    local py=$1 key dir torch_whl t0=$SECONDS
    key=$( { echo "$TORCH_REQUIREMENT python$py $(uname -m)"
             cat "$REPO/containers/cuda/requirements.txt" "$REPO/containers/cuda/requirements-cuda.txt" \
                 "$REPO/envs/requirements-nodeps.txt"; } | sha256sum | cut -c1-12)
    dir="$WHEEL_CACHE/wheels-cuda-py$py-$key"
    if [ -f "$dir/.complete" ]; then
        say "CUDA wheels: cached in $dir (reused)"
    else
        rm -rf "$dir.partial"
        mkdir -p "$dir.partial"
        say "pip wheel $TORCH_REQUIREMENT + pins -> $dir (Python $py; ~3.5 GB the first time)"
        # --no-cache-dir: the wheels are kept here, a second copy in pip's cache would double the disk
        "$PYTHON" -m pip wheel -q --no-cache-dir --wheel-dir "$dir.partial" "$TORCH_REQUIREMENT" \
            -r "$REPO/containers/cuda/requirements.txt" -r "$REPO/containers/cuda/requirements-cuda.txt"
        "$PYTHON" -m pip wheel -q --no-deps --wheel-dir "$dir.partial" -r "$REPO/envs/requirements-nodeps.txt"
        torch_whl=$(ls "$dir.partial"/torch-"$TORCH_VERSION"*.whl | head -1)
        torch_is_cuda "$torch_whl" || { rm -rf "$dir.partial"; die "pip resolved $TORCH_REQUIREMENT to a CPU \
build ($(basename "$torch_whl")); the CUDA variant needs PyPI's CUDA build (TORCH_REQUIREMENT=...)"; }
        rm -rf "$dir"
        mv "$dir.partial" "$dir"
        (cd "$dir" && ls *.whl > .complete)
        find "$WHEEL_CACHE" -maxdepth 1 -name 'wheels-cuda-*' ! -path "$dir" -exec rm -rf {} +
        say "CUDA wheels downloaded in $((SECONDS - t0)) s"
    fi
    rm -rf "$WHEELHOUSE/cuda"
    mkdir -p "$WHEELHOUSE/cuda"
    cp -l "$dir"/*.whl "$WHEELHOUSE/cuda/" 2>/dev/null || cp "$dir"/*.whl "$WHEELHOUSE/cuda/"
    say "wheelhouse/cuda: $(ls "$WHEELHOUSE"/cuda/*.whl | wc -l) wheels, $(du -sh "$dir" | cut -f1), \
torch: $(basename "$(ls "$WHEELHOUSE"/cuda/torch-*.whl)")"
}

cmd_wheels() {
    local variant=${1:-} py
    case "$variant" in cpu|cuda) ;; *) die "variant must be cpu or cuda, got '${variant}'" ;; esac
    command -v podman >/dev/null || die "podman not installed ($0 install)"
    make_base
    podman_env "$BASE_TAG" >/dev/null
    py=$(check_python)
    "wheels_$variant" "$py"
}

cmd_build() {
    local variant=${1:-} tag=${2:-localhost/dflash-eval-${1:-}:0.1.0} t0=$SECONDS network=(--network none) args=()
    cmd_wheels "$variant"
    if [ "$variant" = cuda ]; then network=(); args=(--build-arg WHEELHOUSE=cuda); fi
    say "podman build ${network[*]} -t $tag (VARIANT=$variant, BASE_IMAGE=$BASE_TAG)"
    cd "$REPO"
    podman build "${network[@]}" -f containers/cuda/Dockerfile \
        --build-arg VARIANT="$variant" --build-arg BASE_IMAGE="$BASE_TAG" --build-arg IMAGE="$tag" "${args[@]}" \
        -t "$tag" .
    say "built $tag in $((SECONDS - t0)) s (wheels included): $(podman image inspect --format '{{.Size}}' "$tag" \
        | awk '{printf "%.2f GB", $1 / 1e9}')"
}

case "${1:-}" in
    install) cmd_install ;;
    build) shift; cmd_build "$@" ;;
    wheels) shift; cmd_wheels "$@" ;;
    env)
        command -v podman >/dev/null || die "podman not installed ($0 install)"
        podman image exists "$BASE_TAG" || die "no base image $BASE_TAG yet ($0 build cpu|cuda)"
        podman_env "$BASE_TAG" ;;
    *) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
