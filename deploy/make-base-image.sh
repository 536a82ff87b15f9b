#!/usr/bin/env bash
# Build a local Python 3.11 base image from Debian's packages, for machines that reach
# Debian's package mirror but no container image registry (so `python:3.11-slim` cannot
# be pulled). Debian 12 "bookworm" ships Python 3.11, the version the image expects.
#
#   sudo deploy/make-base-image.sh                # -> image pdserve-base:bookworm
#   docker build --build-arg BASE_IMAGE=pdserve-base:bookworm ...
#
# Idempotent: an existing image with the tag is kept unless FORCE=1.
# Needs root, debootstrap and a running Docker engine.
#
# Environment:
#   BASE_TAG   image tag to create            (default pdserve-base:bookworm)
#   SUITE      Debian suite                    (default bookworm)
#   MIRROR     Debian mirror                   (default http://deb.debian.org/debian)
#   FORCE=1    rebuild even if the tag exists
set -euo pipefail

BASE_TAG=${BASE_TAG:-pdserve-base:bookworm}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
DOCKER=${DOCKER:-docker}

if [ "${FORCE:-0}" != 1 ] && "$DOCKER" image inspect "$BASE_TAG" >/dev/null 2>&1; then
    echo "make-base-image: $BASE_TAG already exists (FORCE=1 rebuilds it)"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "make-base-image: debootstrap needs root" >&2
    exit 1
fi
command -v debootstrap >/dev/null || { echo "make-base-image: apt-get install debootstrap" >&2; exit 1; }

ROOTFS=$(mktemp -d /tmp/pdserve-rootfs.XXXXXX)
cleanup() { rm -rf --one-file-system "$ROOTFS"; }
trap cleanup EXIT

# minbase: essential + apt only. What python:3.11-slim offers that we use:
#   python3 (3.11), venv + ensurepip (the build stage makes a virtualenv),
#   ca-certificates (pip over https), netbase (/etc/services, /etc/protocols),
#   python3-dev (Python.h, which the slim image has too: inductor's generated C++ includes it).
# And g++, which the Dockerfile installs with apt-get on top of python:3.11-slim but cannot
# in an offline build (no apt mirror there): without it the engine runs eagerly and its native
# CPU kernels are off (torch.compile and kernels/cpu/build.py call it at run time).
debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-dev,g++,ca-certificates,netbase \
    "$SUITE" "$ROOTFS" "$MIRROR"

# Slim it down the way the official slim images do.
chroot "$ROOTFS" apt-get clean
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin \
       "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* \
       "$ROOTFS"/var/log/*.log "$ROOTFS"/var/log/apt/* "$ROOTFS"/tmp/*
find "$ROOTFS"/usr/lib/python3* -name '__pycache__' -prune -exec rm -rf {} + 2>/dev/null || true
# `python` as well as `python3`, as in the python:* images.
ln -sf python3 "$ROOTFS"/usr/bin/python

tar --numeric-owner -C "$ROOTFS" -c . | "$DOCKER" import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' \
    - "$BASE_TAG"
echo "make-base-image: built $BASE_TAG"
"$DOCKER" image ls "$BASE_TAG"
