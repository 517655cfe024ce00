#!/usr/bin/env bash
# Install Debian packages that are not installed yet (idempotent; needs root).
# usage: ci/apt-install.sh PACKAGE...
# The system-test fixtures and .ci/run call this for docker.io, debootstrap and nix-bin.
set -euo pipefail
missing=()
for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "apt-install: installing ${missing[*]}" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
