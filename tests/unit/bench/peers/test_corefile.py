"""kubeadm's Corefile, taken from its Go source: string extraction, template, deviation."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.peers.corefile import (
    CorefileError,
    clusterrole_rules,
    configmap_corefile,
    go_string_constant,
    load_kubeadm_coredns,
    pinned_version_from,
    render_template,
    with_forward_to,
    zone_settings,
)

GO_SOURCE = '''package dns

const (
\t// CoreDNSConfigMap is the CoreDNS ConfigMap manifest
\tCoreDNSConfigMap = `
apiVersion: v1
kind: ConfigMap
metadata:
  name: coredns
  namespace: kube-system
data:
  Corefile: |
    .:53 {
        errors
        kubernetes {{ .DNSDomain }} in-addr.arpa ip6.arpa {
           ttl 30
        }
        forward . /etc/resolv.conf {
           max_concurrent 1000
        }
        cache 30
        {{- if .DNSDomain }} {
           disable success {{ .DNSDomain }}
           disable denial {{ .DNSDomain }}
        }
        {{- end }}
        loop
    }
`
\t// CoreDNSClusterRole is the CoreDNS ClusterRole manifest
\tCoreDNSClusterRole = `
kind: ClusterRole
rules:
- apiGroups: [""]
  resources: [services]
  verbs: [list, watch]
`
)
'''

RENDERED = """.:53 {
    errors
    kubernetes cluster.local in-addr.arpa ip6.arpa {
       ttl 30
    }
    forward . /etc/resolv.conf {
       max_concurrent 1000
    }
    cache 30 {
       disable success cluster.local
       disable denial cluster.local
    }
    loop
}
"""


def test_the_constant_is_extracted_and_rendered_byte_for_byte() -> None:
    text = go_string_constant(GO_SOURCE, "CoreDNSConfigMap")
    corefile = configmap_corefile(render_template(text, {"DNSDomain": "cluster.local"}))
    assert corefile == RENDERED


def test_an_empty_domain_drops_the_if_block_and_its_trimmed_whitespace() -> None:
    text = go_string_constant(GO_SOURCE, "CoreDNSConfigMap")
    corefile = configmap_corefile(render_template(text, {"DNSDomain": ""}))
    assert "    cache 30\n    loop\n" in corefile
    assert "disable" not in corefile


@pytest.mark.parametrize(("template", "values", "want"), [
    ("a {{ .X }} b", {"X": "1"}, "a 1 b"),
    ("a  \n {{- .X }} b", {"X": "1"}, "a1 b"),
    ("a {{ .X -}} \n b", {"X": "1"}, "a 1b"),
    ("{{ if .X }}yes{{ end }}|{{ if .Y }}no{{ end }}", {"X": "1", "Y": ""}, "yes|"),
    ("{{ if .X }}{{ if .Y }}both{{ end }}x{{ end }}", {"X": "1", "Y": ""}, "x"),
])
def test_template_subset(template: str, values: dict[str, str], want: str) -> None:
    assert render_template(template, values) == want


@pytest.mark.parametrize(("template", "message"), [
    ("{{ range .X }}", "not supported"),
    ("{{ .Missing }}", "no value"),
    ("{{ if .X }}open", "without {{ end }}"),
    ("{{ end }}", "without an open"),
    ("{{ .X | printf }}", "not supported"),
])
def test_template_constructs_it_does_not_know_are_refused(template: str, message: str) -> None:
    with pytest.raises(CorefileError, match=message):
        render_template(template, {"X": "1"})


def test_a_missing_constant_or_corefile_is_named() -> None:
    with pytest.raises(CorefileError, match="CoreDNSNope"):
        go_string_constant(GO_SOURCE, "CoreDNSNope")
    with pytest.raises(CorefileError, match=r"data\.Corefile"):
        configmap_corefile("kind: ConfigMap\ndata: {}\n")


def test_the_forward_deviation_changes_that_line_only() -> None:
    out = with_forward_to(RENDERED, "127.0.0.1:1053")
    assert out == RENDERED.replace("forward . /etc/resolv.conf", "forward . 127.0.0.1:1053")
    with pytest.raises(CorefileError, match="found 0"):
        with_forward_to(out, "127.0.0.1:1053")
    with pytest.raises(CorefileError, match="found 2"):
        with_forward_to(RENDERED + RENDERED, "x")


def test_zone_settings_read_ttl_cache_and_disables() -> None:
    z = zone_settings(RENDERED)
    assert (z.ttl, z.cache, z.cache_disabled) == (
        30, 30, ("success cluster.local", "denial cluster.local"))
    assert z.describe() == ("kubernetes ttl 30; cache 30 with disable success cluster.local, "
                            "disable denial cluster.local")
    plain = zone_settings(".:53 {\n    kubernetes cluster.local\n    cache\n}\n")
    assert (plain.ttl, plain.cache, plain.cache_disabled) == (None, 3600, ())


def test_clusterrole_rules_and_pinned_version() -> None:
    rules = clusterrole_rules(render_template(
        go_string_constant(GO_SOURCE, "CoreDNSClusterRole"), {}))
    assert rules == [{"apiGroups": [""], "resources": ["services"], "verbs": ["list", "watch"]}]
    assert pinned_version_from("set -e\nK8S_VERSION=v1.37.2\nETCD=v3\n") == "v1.37.2"
    with pytest.raises(CorefileError, match="K8S_VERSION"):
        pinned_version_from("K8S_VERSION=latest\n")


def test_a_missing_module_cache_says_how_to_fill_it(tmp_path: Path) -> None:
    with pytest.raises(CorefileError, match=r"build\.sh"):
        load_kubeadm_coredns("v1.37.2", tmp_path)
