"""The machine's kubectl, as make test uses it (kustomize builds, kubectl against the double).

make test never waits for the realk8s build, so it uses the kubectl on PATH: this machine
kind has one from google-cloud-cli (1.27 to 1.33), with kustomize v5. Its version is
checked against a floor, and one below it fails with the version found (Debian's
``kubernetes-client`` package is 1.20 and builds the manifests differently). A missing
kubectl is a skip, which CI refuses (tests/allowed_skips.toml allows none). The realk8s
tier uses the kubectl it builds beside the apiserver instead (tests/realk8s/harness.py).
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess

import pytest

#: The oldest kubectl make test accepts: kustomize v5 and the apply semantics the tests use.
FLOOR = (1, 27)


@functools.cache
def _version(path: str) -> tuple[tuple[int, int], str]:
    out = subprocess.run([path, "version", "--client", "-o", "json"], capture_output=True,
                         text=True, timeout=60, check=False)
    try:
        info = json.loads(out.stdout)["clientVersion"]
        found = (int(info["major"]), int(str(info["minor"]).rstrip("+")))
        return found, str(info.get("gitVersion", f"v{found[0]}.{found[1]}"))
    except (ValueError, KeyError, TypeError):
        return (0, 0), (out.stdout + out.stderr).strip()[:200] or f"exit {out.returncode}"


def machine_kubectl() -> str:
    """The path of the kubectl on PATH; skips when there is none, fails below ``FLOOR``."""
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is not installed on this machine")
    found, text = _version(path)
    if found < FLOOR:
        pytest.fail(f"{path} is kubectl {text}, below the {FLOOR[0]}.{FLOOR[1]} make test "
                    "needs (kustomize v5); install google-cloud-cli's kubectl, not Debian's "
                    "kubernetes-client", pytrace=False)
    return path
