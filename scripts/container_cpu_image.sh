#!/usr/bin/env bash
# The CPU variant of scripts/container_image.sh, under its earlier name:
#   scripts/container_cpu_image.sh build [TAG]   = scripts/container_image.sh build cpu [TAG]
#   scripts/container_cpu_image.sh env|install   = scripts/container_image.sh env|install
set -euo pipefail
here=$(dirname "$0")
case "${1:-}" in
    build) shift; exec bash "$here/container_image.sh" build cpu "$@" ;;
    *) exec bash "$here/container_image.sh" "$@" ;;
esac
