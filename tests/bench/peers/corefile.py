"""The recipe's cluster DNS configuration: kubeadm's Corefile, verbatim from its source.

Why from the source: which of ``ttl``, ``cache`` and the per-zone cache ``disable`` lines
a cluster gets decides what a recipe user sees after a change (FACTS.md, "The manual
recipe, precisely"), and kubeadm changed them over the years. kubeadm ships the CoreDNS
ConfigMap and ClusterRole as Go ``text/template`` string constants (``CoreDNSConfigMap``,
``CoreDNSClusterRole``) in ``cmd/kubeadm/app/phases/addons/dns/manifests.go`` of the
``k8s.io/kubernetes`` module. The realk8s build (``tests/realk8s/build.sh``) puts that
module, at the pinned version, into the Go module cache; this module reads it from there,
renders the template with the cluster's domain exactly as kubeadm's ``ParseTemplate``
would for the constructs it uses, and fails naming the construct if a later version uses
one it does not know, rather than guess.

The one deviation, stated where it is made (:func:`with_forward_to`):
``forward . /etc/resolv.conf`` would send every name outside the cluster zone to this machine's own
resolver, and no traffic may leave the machine, so it points at a local sink instead.
Everything else, ``.:53`` included, is kubeadm's text: CoreDNS runs in a network
namespace of its own, where port 53, 8080 (health), 8181 (ready) and 9153 (prometheus)
are free.

Pure except :func:`pinned_kubernetes_version`, :func:`go_modcache` and
:func:`load_kubeadm_coredns`, which read files and ask ``go env``.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[3]
BUILD_SCRIPT = REPO_ROOT / "tests" / "realk8s" / "build.sh"
KUBEADM_DNS_MANIFESTS = "cmd/kubeadm/app/phases/addons/dns/manifests.go"
#: the forward target kubeadm writes, replaced by the stated deviation
KUBEADM_FORWARD = "forward . /etc/resolv.conf"


class CorefileError(Exception):
    """kubeadm's source could not be found or read as expected (the message says where)."""


# ------------------------------------------------------------------ pure parts


def go_string_constant(source: str, name: str) -> str:
    """The raw (backquoted) string literal assigned to ``name`` in Go ``source``."""
    m = re.search(rf"(?m)^\s*{re.escape(name)}\s*=\s*`([^`]*)`", source)
    if m is None:
        raise CorefileError(f"no raw string constant {name} = `...` in the source")
    return m.group(1)


_ACTION = re.compile(r"\{\{(-\s)?\s*(.*?)\s*(\s-)?\}\}", re.S)


def render_template(text: str, values: Mapping[str, str]) -> str:
    """Render the subset of Go ``text/template`` kubeadm's DNS manifests use.

    Supported: ``{{ .Field }}``, ``{{ if .Field }} ... {{ end }}`` (nested, truthy when the
    value is a non-empty string), and the trim markers ``{{- `` / `` -}}``, which remove
    all whitespace (newlines included) before / after the action, as Go does. Anything
    else raises :class:`CorefileError` naming the action.
    """
    pieces: list[tuple[str, str]] = []  # ("text", s) | ("action", body)
    pos = 0
    for m in _ACTION.finditer(text):
        before = text[pos:m.start()]
        if m.group(1):
            before = before.rstrip(" \t\r\n")
        pieces.append(("text", before))
        pieces.append(("action", m.group(2)))
        pos = m.end()
        if m.group(3):
            rest = text[pos:]
            pos += len(rest) - len(rest.lstrip(" \t\r\n"))
    pieces.append(("text", text[pos:]))
    # a trim marker on an action trims the text piece before it, already done; the
    # right marker moved ``pos`` past the whitespace

    out: list[str] = []
    stack: list[bool] = []  # emitting state of the enclosing blocks

    def emitting() -> bool:
        return all(stack)

    def field(expr: str) -> str:
        if not re.fullmatch(r"\.[A-Za-z_][A-Za-z0-9_]*", expr):
            raise CorefileError(f"template action {{{{ {expr} }}}} is not a plain field")
        name = expr[1:]
        if name not in values:
            raise CorefileError(f"template field .{name} has no value")
        return values[name]

    for kind, body in pieces:
        if kind == "text":
            if emitting():
                out.append(body)
            continue
        words = body.split()
        if words and words[0] == "if" and len(words) == 2:
            stack.append(bool(field(words[1])))
        elif words == ["end"]:
            if not stack:
                raise CorefileError("template {{ end }} without an open {{ if }}")
            stack.pop()
        elif len(words) == 1 and words[0].startswith("."):
            if emitting():
                out.append(field(words[0]))
        else:
            raise CorefileError(f"template action {{{{ {body} }}}} is not supported")
    if stack:
        raise CorefileError("template {{ if }} without {{ end }}")
    return "".join(out)


def configmap_corefile(manifest: str) -> str:
    """``data.Corefile`` of a rendered ConfigMap manifest."""
    doc = yaml.safe_load(manifest)
    try:
        corefile = doc["data"]["Corefile"]
    except (TypeError, KeyError) as e:
        raise CorefileError(f"the ConfigMap has no data.Corefile ({e})") from e
    if not isinstance(corefile, str) or not corefile.strip():
        raise CorefileError("data.Corefile is empty")
    return corefile


def with_forward_to(corefile: str, sink: str) -> str:
    """The stated deviation: ``forward . /etc/resolv.conf`` -> ``forward . <sink>``.

    Exactly one such line must be there; anything else in the file stays byte for byte.
    """
    count = corefile.count(KUBEADM_FORWARD)
    if count != 1:
        raise CorefileError(f"expected one {KUBEADM_FORWARD!r} line in the Corefile, "
                            f"found {count}")
    return corefile.replace(KUBEADM_FORWARD, f"forward . {sink}")


@dataclass(frozen=True)
class ZoneSettings:
    """What the Corefile says about answers for the cluster zone (for the report)."""

    ttl: int | None  # the kubernetes plugin's ttl (plugin default 5 when absent)
    cache: int | None  # the cache plugin's max TTL (None: no cache plugin)
    cache_disabled: tuple[str, ...]  # "success cluster.local", "denial cluster.local", ...

    def describe(self) -> str:
        ttl = f"ttl {self.ttl}" if self.ttl is not None else "ttl 5 (plugin default)"
        cache = f"cache {self.cache}" if self.cache is not None else "no cache plugin"
        off = (" with " + ", ".join(f"disable {d}" for d in self.cache_disabled)
               if self.cache_disabled else "")
        return f"kubernetes {ttl}; {cache}{off}"


def zone_settings(corefile: str) -> ZoneSettings:
    """Read the kubernetes plugin's ``ttl`` and the cache plugin's settings."""
    ttl = None
    kube = re.search(r"(?ms)^\s*kubernetes\b[^{\n]*\{(.*?)^\s*\}", corefile)
    if kube:
        m = re.search(r"(?m)^\s*ttl\s+(\d+)", kube.group(1))
        ttl = int(m.group(1)) if m else None
    cache = None
    disabled: list[str] = []
    m = re.search(r"(?m)^\s*cache(?:\s+(\d+))?\s*(\{)?", corefile)
    if m:
        cache = int(m.group(1)) if m.group(1) else 3600
        if m.group(2):
            block = corefile[m.end():corefile.index("}", m.end())]
            disabled = [" ".join(line.split()[1:]) for line in block.splitlines()
                        if line.split()[:1] == ["disable"]]
    return ZoneSettings(ttl, cache, tuple(disabled))


def clusterrole_rules(manifest: str) -> list[dict[str, Any]]:
    """The ``rules`` of a rendered ClusterRole manifest."""
    doc = yaml.safe_load(manifest)
    rules = doc.get("rules") if isinstance(doc, dict) else None
    if not isinstance(rules, list) or not rules:
        raise CorefileError("the ClusterRole has no rules")
    return rules


def pinned_version_from(build_script: str) -> str:
    m = re.search(r"(?m)^K8S_VERSION=(v\d+\.\d+\.\d+)\s*$", build_script)
    if m is None:
        raise CorefileError(f"no K8S_VERSION=vX.Y.Z line in {BUILD_SCRIPT}")
    return m.group(1)


# ------------------------------------------------------------------ reading the cache


def pinned_kubernetes_version() -> str:
    """The Kubernetes version tests/realk8s/build.sh pins (one source of truth)."""
    return pinned_version_from(BUILD_SCRIPT.read_text())


def go_modcache() -> Path:
    """The Go module cache (``GOMODCACHE``, else ``go env GOMODCACHE``)."""
    env = os.environ.get("GOMODCACHE")
    if env:
        return Path(env)
    go = "/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else "go"
    try:
        out = subprocess.run([go, "env", "GOMODCACHE"], capture_output=True, text=True,
                             check=True, timeout=30, env={**os.environ, "GOTOOLCHAIN": "local"})
    except (OSError, subprocess.SubprocessError) as e:
        raise CorefileError(f"cannot ask go for GOMODCACHE: {e}") from e
    return Path(out.stdout.strip())


@dataclass(frozen=True)
class KubeadmCoreDNS:
    """kubeadm's CoreDNS Corefile and ClusterRole at one Kubernetes version."""

    version: str
    source: Path  # the manifests.go file read
    corefile: str  # rendered, before the forward deviation
    rules: list[dict[str, Any]]

    @property
    def citation(self) -> str:
        return f"k8s.io/kubernetes@{self.version}/{KUBEADM_DNS_MANIFESTS} (CoreDNSConfigMap)"


def load_kubeadm_coredns(version: str | None = None, modcache: Path | None = None,
                         dns_domain: str = "cluster.local") -> KubeadmCoreDNS:
    version = version or pinned_kubernetes_version()
    path = (modcache or go_modcache()) / f"k8s.io/kubernetes@{version}" / KUBEADM_DNS_MANIFESTS
    try:
        source = path.read_text()
    except OSError as e:
        raise CorefileError(f"cannot read kubeadm's DNS manifests at {path}: {e} (run "
                            "bash tests/realk8s/build.sh: it fills the Go module cache)") from e
    values = {"DNSDomain": dns_domain, "UpstreamNameserver": "", "StubDomain": ""}
    corefile = configmap_corefile(render_template(go_string_constant(source, "CoreDNSConfigMap"),
                                                  values))
    rules = clusterrole_rules(render_template(go_string_constant(source, "CoreDNSClusterRole"),
                                              values))
    return KubeadmCoreDNS(version, path, corefile, rules)
