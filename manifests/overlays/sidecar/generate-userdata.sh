#!/bin/sh
# Regenerates secret-userdata.yaml for the sidecar layout: no --registry-url
# (each sidecar serves only its own VMI), so guests learn peers from DNS. The
# file is replaced by rename (--output): on any error it keeps its old content
# and the script exits non-zero. OUTPUT=PATH writes elsewhere.
set -eu
cd "$(dirname "$0")"
exec imex-guest-agent cloudinit \
  --ensemble gb200 \
  --namespace gpu-jobs \
  --max-members 18 \
  --install preinstalled \
  --output-secret gb200-userdata-dns \
  --output "${OUTPUT:-secret-userdata.yaml}"
