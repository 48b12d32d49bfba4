#!/usr/bin/env bash
# Build the real control plane (etcd, kube-apiserver, kube-controller-manager,
# CoreDNS), kubectl and Helm from the Go module proxy, pinned, into a cache keyed by
# versions.
#
# Why a script and no committed go.mod: each component is built in its own
# throwaway wrapper module generated under the cache directory, so the three
# dependency graphs never meet (one shared module would let MVS lift grpc or
# client-go for one component and break another). k8s.io/kubernetes points its
# staging modules at ./staging/src with `replace`, which a dependent module
# ignores, so the wrapper pins every k8s.io/<staging> module to the matching
# v0.<minor>.<patch>; the list is read from that version's own go.mod, never
# hand-maintained. etcd's server module does the same for its siblings.
#
# The cache key has two parts: the bin directory's name (Kubernetes, etcd, CoreDNS and Go
# versions) and Helm's own stamp in it (.complete-helm: Helm's version and Go's). Helm is
# a client: bumping it rebuilds Helm alone, beside the control plane it is tested on.
#
# Output: the bin directory on stdout (last line). A warm run only checks the
# stamp files and returns in well under a second.
#
# `build.sh --check`: print the bin directory and exit 0 when the build is complete,
# exit 1 without building otherwise (for CI: run the tier only on a warm cache).
#
# Env: REALK8S_CACHE overrides the cache root; REALK8S_NICE (default 15) is the
# niceness for the compiler (the machine has 2 shared cores).
set -euo pipefail

K8S_VERSION=v1.37.2
ETCD_VERSION=v3.7.3
COREDNS_VERSION=v1.15.0
HELM_VERSION=v4.3.2

GO=${GO:-/usr/local/go/bin/go}
[ -x "$GO" ] || GO=$(command -v go || true)
if [ -z "$GO" ]; then
  echo "realk8s-build: no Go toolchain (neither \$GO, /usr/local/go/bin/go nor go on PATH)" >&2
  exit 1
fi
export GOTOOLCHAIN=local
export GOFLAGS="-mod=mod -buildvcs=false"
GO_VERSION=$("$GO" env GOVERSION)

KEY="k8s-${K8S_VERSION}_etcd-${ETCD_VERSION}_coredns-${COREDNS_VERSION}_${GO_VERSION}"
ROOT=${REALK8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/imex-ensemble/realk8s}
DIR="$ROOT/$KEY"
BIN="$DIR/bin"
STAMP="$BIN/.complete"
HELM_STAMP="$BIN/.complete-helm"
HELM_KEY="helm.sh/helm/v4 $HELM_VERSION $GO_VERSION"
NICE=${REALK8S_NICE:-15}
# kubectl is built at the apiserver's version: the machine's kubectl (1.27-1.33) is out of
# the one-minor skew kubectl supports against 1.37 (printer columns, describe).
BINARIES=(kube-apiserver kube-controller-manager kubectl etcd coredns)

complete_k8s() {
  [ -f "$STAMP" ] || return 1
  local b
  for b in "${BINARIES[@]}"; do [ -x "$BIN/$b" ] || return 1; done
}
complete_helm() {
  [ -x "$BIN/helm" ] && [ "$(cat "$HELM_STAMP" 2>/dev/null)" = "$HELM_KEY" ]
}
complete() { complete_k8s && complete_helm; }

if complete; then
  echo "$BIN"
  exit 0
fi
if [ "${1:-}" = "--check" ]; then
  echo "realk8s-build: no complete build in $BIN" >&2
  exit 1
fi

log() { echo "realk8s-build: $*" >&2; }

# One builder per key at a time (two test runs starting cold would otherwise rewrite
# each other's wrapper modules); the second waits, then finds the stamp.
mkdir -p "$DIR/src" "$BIN"
exec 9>"$DIR/.lock"
flock 9
if complete; then
  echo "$BIN"
  exit 0
fi
K8S_V0="v0.${K8S_VERSION#v1.}"

# new_module DIR NAME: a fresh wrapper module (go.mod rewritten every cold run).
new_module() {
  rm -rf "$1"
  mkdir -p "$1"
  (cd "$1" && "$GO" mod init "imex-ensemble.invalid/realk8s/$2" >/dev/null 2>&1 \
    && "$GO" mod edit -go=1.26.0)
}

build() { # build MODDIR OUTNAME PACKAGE [ldflags]
  local mod=$1 out=$2 pkg=$3 ldflags=${4:-}
  log "building $out from $pkg"
  local t0=$SECONDS
  (cd "$mod" && nice -n "$NICE" "$GO" build -trimpath -ldflags "-s -w $ldflags" \
    -o "$BIN/$out.tmp" "$pkg")
  mv "$BIN/$out.tmp" "$BIN/$out"
  log "built $out in $((SECONDS - t0))s"
}

build_k8s() {
  # --- Kubernetes -------------------------------------------------------------
  K8S_MOD="$DIR/src/kubernetes"
  new_module "$K8S_MOD" kubernetes
  (cd "$K8S_MOD" && "$GO" mod edit -require="k8s.io/kubernetes@$K8S_VERSION")
  k8s_gomod=$(cd "$K8S_MOD" && "$GO" mod download -json "k8s.io/kubernetes@$K8S_VERSION" \
    | sed -n 's/^\t"GoMod": "\(.*\)",$/\1/p')
  [ -f "$k8s_gomod" ] || { log "cannot find go.mod of k8s.io/kubernetes@$K8S_VERSION"; exit 1; }
  staging=$(sed -n 's#^\s*\(k8s\.io/[a-z0-9./-]*\) => \./staging/.*#\1#p' "$k8s_gomod")
  [ -n "$staging" ] || { log "no staging replaces found in $k8s_gomod"; exit 1; }
  edits=()
  for m in $staging; do edits+=("-replace=$m=$m@$K8S_V0"); done
  (cd "$K8S_MOD" && "$GO" mod edit "${edits[@]}")
  k8s_ld="-X k8s.io/component-base/version.gitVersion=$K8S_VERSION"
  k8s_ld+=" -X k8s.io/component-base/version.gitMajor=1"
  k8s_ld+=" -X k8s.io/component-base/version.gitMinor=$(echo "$K8S_VERSION" | cut -d. -f2)"
  k8s_ld+=" -X k8s.io/component-base/version.gitTreeState=clean"
  for cmd in kube-apiserver kube-controller-manager kubectl; do
    [ -x "$BIN/$cmd" ] || build "$K8S_MOD" "$cmd" "k8s.io/kubernetes/cmd/$cmd" "$k8s_ld"
  done

  # --- etcd ---------------------------------------------------------------------
  ETCD_MOD="$DIR/src/etcd"
  new_module "$ETCD_MOD" etcd
  (cd "$ETCD_MOD" && "$GO" mod edit -require="go.etcd.io/etcd/server/v3@$ETCD_VERSION" \
    -replace="go.etcd.io/etcd/api/v3=go.etcd.io/etcd/api/v3@$ETCD_VERSION" \
    -replace="go.etcd.io/etcd/client/pkg/v3=go.etcd.io/etcd/client/pkg/v3@$ETCD_VERSION" \
    -replace="go.etcd.io/etcd/client/v3=go.etcd.io/etcd/client/v3@$ETCD_VERSION" \
    -replace="go.etcd.io/etcd/pkg/v3=go.etcd.io/etcd/pkg/v3@$ETCD_VERSION")
  [ -x "$BIN/etcd" ] || build "$ETCD_MOD" etcd go.etcd.io/etcd/server/v3

  # --- CoreDNS ----------------------------------------------------------------
  DNS_MOD="$DIR/src/coredns"
  new_module "$DNS_MOD" coredns
  (cd "$DNS_MOD" && "$GO" mod edit -require="github.com/coredns/coredns@$COREDNS_VERSION")
  [ -x "$BIN/coredns" ] || build "$DNS_MOD" coredns github.com/coredns/coredns

  {
    echo "k8s.io/kubernetes $K8S_VERSION"
    echo "go.etcd.io/etcd/server/v3 $ETCD_VERSION"
    echo "github.com/coredns/coredns $COREDNS_VERSION"
    echo "go $GO_VERSION"
  } > "$STAMP"
}

# --- Helm ---------------------------------------------------------------------
# Its go.mod has no replace directives and pins client-go at the apiserver's own
# v0.37.2; the version string is set as Helm's Makefile sets it for a release.
build_helm() {
  local mod="$DIR/src/helm"
  new_module "$mod" helm
  (cd "$mod" && "$GO" mod edit -require="helm.sh/helm/v4@$HELM_VERSION")
  rm -f "$HELM_STAMP"
  CGO_ENABLED=0 build "$mod" helm helm.sh/helm/v4/cmd/helm \
    "-X helm.sh/helm/v4/internal/version.version=$HELM_VERSION"
  echo "$HELM_KEY" > "$HELM_STAMP"
}

complete_k8s || build_k8s
complete_helm || build_helm
echo "$BIN"
