"""kubeadm's CoreDNS Corefile, read from the Kubernetes module the realk8s build fetched.

bench-peers runs the manual recipe with kubeadm's own Corefile at the version build.sh
pins (tests/bench/peers/corefile.py); this reads the real file from the Go module cache.
It lives in the realk8s tier because that tier's build is what fills the cache (make
test runs before it), so here a missing module is a failure, never a skip.
"""

from __future__ import annotations

import pytest

from tests.bench.peers.corefile import (
    KUBEADM_DNS_MANIFESTS,
    go_modcache,
    load_kubeadm_coredns,
    pinned_kubernetes_version,
    zone_settings,
)

pytestmark = pytest.mark.realk8s


def test_the_pinned_version_in_the_module_cache() -> None:
    version = pinned_kubernetes_version()
    cache = go_modcache()
    assert (cache / f"k8s.io/kubernetes@{version}" / KUBEADM_DNS_MANIFESTS).exists(), \
        f"k8s.io/kubernetes@{version} is not in {cache}: tests/realk8s/build.sh fills it"
    k = load_kubeadm_coredns(version, cache)
    assert k.corefile.startswith(".:53 {\n")
    assert "forward . /etc/resolv.conf {" in k.corefile
    assert zone_settings(k.corefile).ttl is not None
    assert any("endpointslices" in r.get("resources", []) for r in k.rules)
    assert k.citation.startswith(f"k8s.io/kubernetes@{version}/cmd/kubeadm/")
