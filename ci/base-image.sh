#!/usr/bin/env bash
# Make a Debian base image without any image registry: debootstrap a minimal root file system from the Debian
# mirror this machine's apt is configured with, then `docker import` it. The image stands in for the public
# base images (python:3.x-slim, nvidia/cuda) when no registry is reachable.
#
# usage: ci/base-image.sh [TAG]      (default TAG: primerl-base:debian-<suite>); prints TAG.
# env:   SUITE      Debian suite (default: this host's codename, else bookworm)
#        MIRROR     Debian mirror URL (default: the one apt is configured with for SUITE)
#        PACKAGES   extra packages (default: what primerl's Dockerfiles expect of a base: Python with venv, CA certs)
#        CA_BUNDLE  the certificate bundle the image trusts (default: this machine's, $SSL_CERT_FILE or Debian's
#                   /etc/ssl/certs/ca-certificates.crt), so builds reach the package index through whatever TLS
#                   proxy this machine trusts; SSL_CERT_FILE, PIP_CERT and REQUESTS_CA_BUNDLE point at it in the image
# An existing TAG is reused, not rebuilt. Needs root, debootstrap and a running Docker daemon.
set -euo pipefail
suite="${SUITE:-$(. /etc/os-release 2>/dev/null && [ "${ID:-}" = debian ] && echo "${VERSION_CODENAME:-}")}"
suite="${suite:-bookworm}"
tag="${1:-primerl-base:debian-$suite}"
packages="${PACKAGES:-python3,python3-venv,ca-certificates}"
ca_bundle="${CA_BUNDLE:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}"
bundle_in_image=/etc/ssl/certs/ca-certificates.crt

if docker image inspect "$tag" >/dev/null 2>&1; then echo "$tag"; exit 0; fi
command -v debootstrap >/dev/null || "$(dirname "$0")/apt-install.sh" debootstrap

mirror="${MIRROR:-}"
if [ -z "$mirror" ]; then
    # The repository apt uses for the suite itself (not -updates / -security).
    mirror="$(apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 2>/dev/null \
              | awk -v s="$suite" '$2 == s { print $1; exit }')"
fi
if [ -z "$mirror" ]; then
    echo "base-image: no apt source for suite '$suite' is configured here; set MIRROR=<debian mirror URL>" >&2
    exit 1
fi

rootfs="$(mktemp -d "${TMPDIR:-/tmp}/primerl-rootfs.XXXXXX")"
trap 'rm -rf "$rootfs"' EXIT
echo "base-image: debootstrap $suite from $mirror" >&2
debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror" >&2
# Leave the image small and its apt usable: no package cache, sources pointing at the same mirror.
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
echo "deb $mirror $suite main" > "$rootfs/etc/apt/sources.list"
cp "$ca_bundle" "$rootfs$bundle_in_image"
chmod 0755 "$rootfs"  # mktemp made it 0700; it becomes the image's /, which every user must traverse
tar -C "$rootfs" -c . | docker import \
    --change "ENV LANG=C.UTF-8 SSL_CERT_FILE=$bundle_in_image PIP_CERT=$bundle_in_image REQUESTS_CA_BUNDLE=$bundle_in_image" \
    --change 'CMD ["/bin/bash"]' \
    --message "debootstrap $suite (minbase) + $packages" - "$tag" >&2
echo "$tag"
