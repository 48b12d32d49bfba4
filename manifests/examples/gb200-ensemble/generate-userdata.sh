#!/bin/sh
# Regenerates secret-userdata.yaml (tests/integration/test_manifests.py runs
# this and compares). For a real ensemble use your own token:
#   openssl rand -hex 32 > my.token
#   TOKEN_FILE=my.token ./generate-userdata.sh > secret-userdata.yaml
# and put the sha256 it prints on stderr into service.yaml.
set -eu
cd "$(dirname "$0")"
exec imex-guest-agent cloudinit \
  --ensemble gb200 \
  --namespace gpu-jobs \
  --max-members 18 \
  --registry-url http://imex-host-agent.imex-system.svc.cluster.local:8080 \
  --token-file "${TOKEN_FILE:-example.token}" \
  --install preinstalled \
  --output-secret gb200-userdata
