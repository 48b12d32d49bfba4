#!/bin/sh
# Regenerates the examples in this directory (or in $1) with the installed
# `imex-guest-agent cloudinit`. tests/integration/test_cloudinit_schema.py
# runs it into a scratch directory and compares. The token is a placeholder.
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here}"
gen() { file="$1"; shift; imex-guest-agent cloudinit "$@" > "$out/$file"; }
registry=http://imex-host-agent.imex-system.svc.cluster.local:8080
token=replace-me-with-the-output-of-openssl-rand-hex-32

# Baked image. With the token it is a Secret (over 2048 bytes, and the token
# belongs in one anyway); without --token it would fit inline.
gen preinstalled.secret.yaml --ensemble gb200 --namespace gpu-jobs \
  --registry-url "$registry" --token "$token" --install preinstalled

# Air-gapped wheelhouse (pip --no-index --find-links): over 2048 bytes, so a Secret.
gen find-links.secret.yaml --ensemble gb200 --namespace gpu-jobs \
  --registry-url "$registry" --token "$token" \
  --install find-links:http://wheels.example.internal/imex/

# Package index, IMEX older than 570.158.01 (nodes file of IPs), 8 members.
gen pip-index-ips.secret.yaml --ensemble train --namespace ml --max-members 8 \
  --registry-url "$registry" --token "$token" \
  --install pip-index:https://mirror.example.internal/simple/ \
  --mode ips --own-slot published --wait-for-quorum NONE
