#!/usr/bin/env bash
# Build the CPU variant of the dflash-eval image (containers/cuda/Dockerfile, VARIANT=cpu) with
# podman, offline, on a Debian base made by debootstrap (no container registry needed).
#
#   scripts/container_cpu_image.sh build [TAG]   # default TAG localhost/dflash-eval-cpu:0.1.0
#   eval "$(scripts/container_cpu_image.sh env)" # CONTAINERS_CONF where this host needs one (below)
#   scripts/container_cpu_image.sh install       # apt-get podman debootstrap runc (root) if missing
#
# build:
#   1. base image $BASE_TAG (default localhost/dflash-eval-base:bookworm): reused when podman has
#      it, else `debootstrap --variant=minbase bookworm` with python3 + python3-venv from
#      $DEBIAN_MIRROR (default http://deb.debian.org/debian), imported with `podman import`.
#   2. containers/cuda/wheelhouse/: `pip wheel` of torch==2.13.0, containers/cuda/requirements.txt
#      and envs/requirements-nodeps.txt with the host's pip ($PYTHON, default python3, whose
#      major.minor must equal the base's python3). It must resolve torch to the CPU build: give
#      pip the CPU wheel (PIP_FIND_LINKS=<folder with torch-2.13.0+cpu-*.whl>) or the CPU index
#      (PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu); a CUDA torch wheel is refused
#      (the default one on PyPI pulls several GB of CUDA libraries).
#   3. `podman build --network none` with the wheelhouse bind-mounted (no network in the build).
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
WHEELHOUSE="$REPO/containers/cuda/wheelhouse"
CONF_DIR=${DFLASH_EVAL_PODMAN_CONF_DIR:-${TMPDIR:-/tmp}/dflash-eval-podman}

say() { echo "container_cpu_image: $*" >&2; }
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
# Written by scripts/container_cpu_image.sh: podman settings for a host where the defaults fail.
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

make_wheelhouse() {
    local host_py base_py torch_whl
    host_py=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    base_py=$(podman run --rm --network none "$BASE_TAG" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [ "$host_py" = "$base_py" ] || die "host $PYTHON is Python $host_py but the base image has $base_py: \
wheels would not match (PYTHON=python$base_py $0 build)"
    mkdir -p "$WHEELHOUSE"
    say "pip wheel -> containers/cuda/wheelhouse (Python $host_py)"
    "$PYTHON" -m pip wheel -q --wheel-dir "$WHEELHOUSE" "torch==$TORCH_VERSION" -r "$REPO/containers/cuda/requirements.txt"
    "$PYTHON" -m pip wheel -q --no-deps --wheel-dir "$WHEELHOUSE" -r "$REPO/envs/requirements-nodeps.txt"
    torch_whl=$(ls "$WHEELHOUSE"/torch-"$TORCH_VERSION"*.whl | head -1)
    if ! "$PYTHON" - "$torch_whl" <<'EOF'
import sys, zipfile
whl = sys.argv[1]
with zipfile.ZipFile(whl) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    cuda = [l for l in z.read(meta).decode().splitlines()
            if l.startswith("Requires-Dist:") and ("nvidia-" in l or "cuda-toolkit" in l)]
sys.exit(1 if cuda else 0)
EOF
    then
        rm -f "$torch_whl"
        die "pip resolved torch==$TORCH_VERSION to a CUDA build ($(basename "$torch_whl")). Give it the CPU \
wheel: PIP_FIND_LINKS=<folder with torch-$TORCH_VERSION+cpu-*.whl> or \
PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu"
    fi
    say "wheelhouse: $(ls "$WHEELHOUSE"/*.whl | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1), torch: $(basename "$torch_whl")"
}

cmd_build() {
    local tag=${1:-localhost/dflash-eval-cpu:0.1.0}
    command -v podman >/dev/null || die "podman not installed ($0 install)"
    make_base
    podman_env "$BASE_TAG" >/dev/null
    make_wheelhouse
    say "podman build --network none -t $tag (VARIANT=cpu, BASE_IMAGE=$BASE_TAG)"
    cd "$REPO"
    podman build --network none -f containers/cuda/Dockerfile \
        --build-arg VARIANT=cpu --build-arg BASE_IMAGE="$BASE_TAG" --build-arg IMAGE="$tag" \
        -t "$tag" .
    say "built $tag"
}

case "${1:-}" in
    install) cmd_install ;;
    build) shift; cmd_build "$@" ;;
    env)
        command -v podman >/dev/null || die "podman not installed ($0 install)"
        podman image exists "$BASE_TAG" || die "no base image $BASE_TAG yet ($0 build)"
        podman_env "$BASE_TAG" ;;
    *) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
