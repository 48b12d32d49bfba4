#!/bin/sh
# Regenerates secret-userdata.yaml (tests/integration/test_manifests.py runs
# this and compares). The ensemble's name, namespace, maxMembers, port and mode
# come from imexensemble.yaml (--from-ensemble), so the user-data cannot
# disagree with it; the token must hash to its spec.tokenSHA256, so put the
# hash in first (docs/install.md, step 4). For a real ensemble use your own
# token:
#   openssl rand -hex 32 > my.token
#   printf %s "$(cat my.token)" | sha256sum    # -> spec.tokenSHA256
#   TOKEN_FILE=my.token ./generate-userdata.sh
# The file is replaced by rename (--output): on any error it keeps its old
# content and the script exits non-zero. OUTPUT=PATH writes elsewhere.
# Reading YAML needs PyYAML (pip install '.[cloudinit]'); from the cluster,
# JSON needs nothing:
#   kubectl get imexensemble gb200 -n gpu-jobs -o json | ENSEMBLE=- ./generate-userdata.sh
# (With service-only.yaml, give --ensemble gb200 --namespace gpu-jobs
# --max-members 18 instead of --from-ensemble.)
set -eu
cd "$(dirname "$0")"
exec imex-guest-agent cloudinit \
  --from-ensemble "${ENSEMBLE:-imexensemble.yaml}" \
  --registry-url http://imex-host-agent.imex-system.svc.cluster.local:8080 \
  --token-file "${TOKEN_FILE:-example.token}" \
  --install preinstalled \
  --output-secret gb200-userdata \
  --output "${OUTPUT:-secret-userdata.yaml}"
