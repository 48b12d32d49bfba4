#!/usr/bin/env bash
# Build what a real node needs (issue 25 part 2, `make realnode`): kubelet, kube-scheduler
# and kube-proxy from the same Kubernetes release and in the same way as build.sh (a
# throwaway wrapper module pinning every staging module), containerd v2 (containerd,
# containerd-shim-runc-v2, ctr) and runc from the Go module proxy, and the `pause` binary
# from the Kubernetes module's build/pause/linux/pause.c with musl-gcc -static.
#
# A separate cache key and stamp from build.sh's, so the control-plane build (and CI's cold
# build) does not grow: this runs only on demand. Output: the bin directory (last line).
# `build_node.sh --check`: print it and exit 0 when complete, exit 1 without building.
#
# Needs: the Go toolchain, a C compiler and libseccomp-dev (runc is cgo with seccomp),
# musl-tools (musl-gcc) for the static pause. Env: REALK8S_CACHE as build.sh; REALK8S_NICE
# (default 19 here: the node build runs beside other work, never in CI).
set -euo pipefail

K8S_VERSION=v1.37.2
CONTAINERD_VERSION=v2.4.2
RUNC_VERSION=v1.5.3

GO=${GO:-/usr/local/go/bin/go}
[ -x "$GO" ] || GO=$(command -v go || true)
if [ -z "$GO" ]; then
  echo "realnode-build: no Go toolchain (neither \$GO, /usr/local/go/bin/go nor go on PATH)" >&2
  exit 1
fi
export GOTOOLCHAIN=local
export GOFLAGS="-mod=mod -buildvcs=false"
GO_VERSION=$("$GO" env GOVERSION)

KEY="node-k8s-${K8S_VERSION}_containerd-${CONTAINERD_VERSION}_runc-${RUNC_VERSION}_${GO_VERSION}"
ROOT=${REALK8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/imex-ensemble/realk8s}
DIR="$ROOT/$KEY"
BIN="$DIR/bin"
STAMP="$BIN/.complete"
NICE=${REALK8S_NICE:-19}
BINARIES=(kubelet kube-scheduler kube-proxy containerd containerd-shim-runc-v2 ctr runc pause)

complete() {
  [ -f "$STAMP" ] || return 1
  local b
  for b in "${BINARIES[@]}"; do [ -x "$BIN/$b" ] || return 1; done
}

if complete; then
  echo "$BIN"
  exit 0
fi
if [ "${1:-}" = "--check" ]; then
  echo "realnode-build: no complete build in $BIN" >&2
  exit 1
fi

log() { echo "realnode-build: $*" >&2; }

for tool in musl-gcc pkg-config; do
  command -v "$tool" >/dev/null || { log "$tool not found (apt-get install musl-tools pkg-config)"; exit 1; }
done
pkg-config --exists libseccomp || { log "libseccomp not found by pkg-config (apt-get install libseccomp-dev)"; exit 1; }

mkdir -p "$DIR/src" "$BIN"
exec 9>"$DIR/.lock"
flock 9
if complete; then
  echo "$BIN"
  exit 0
fi
K8S_V0="v0.${K8S_VERSION#v1.}"

new_module() { # new_module DIR NAME
  rm -rf "$1"
  mkdir -p "$1"
  (cd "$1" && "$GO" mod init "imex-ensemble.invalid/realnode/$2" >/dev/null 2>&1 \
    && "$GO" mod edit -go=1.26.0)
}

build() { # build MODDIR OUTNAME PACKAGE [ldflags] [tags]; CGO_ENABLED from the caller
  local mod=$1 out=$2 pkg=$3 ldflags=${4:-} tags=${5:-}
  log "building $out from $pkg"
  local t0=$SECONDS
  (cd "$mod" && nice -n "$NICE" "$GO" build -trimpath ${tags:+-tags "$tags"} \
    -ldflags "-s -w $ldflags" -o "$BIN/$out.tmp" "$pkg")
  mv "$BIN/$out.tmp" "$BIN/$out"
  log "built $out in $((SECONDS - t0))s"
}

# --- pause (static C) ---------------------------------------------------------------
K8S_MOD="$DIR/src/kubernetes"
new_module "$K8S_MOD" kubernetes
(cd "$K8S_MOD" && "$GO" mod edit -require="k8s.io/kubernetes@$K8S_VERSION")
k8s_json=$(cd "$K8S_MOD" && "$GO" mod download -json "k8s.io/kubernetes@$K8S_VERSION")
k8s_gomod=$(sed -n 's/^\t"GoMod": "\(.*\)",$/\1/p' <<<"$k8s_json")
k8s_src=$(sed -n 's/^\t"Dir": "\(.*\)",$/\1/p' <<<"$k8s_json")
[ -f "$k8s_gomod" ] || { log "cannot find go.mod of k8s.io/kubernetes@$K8S_VERSION"; exit 1; }
if [ ! -x "$BIN/pause" ]; then
  pause_c="$k8s_src/build/pause/linux/pause.c"
  [ -f "$pause_c" ] || { log "no $pause_c"; exit 1; }
  # The version the upstream Makefile stamps into the binary (pause -v)
  pause_tag=$(sed -n 's/^TAG ?= *//p' "$k8s_src/build/pause/Makefile")
  musl-gcc -Os -Wall -Werror -static -DVERSION="v$pause_tag-imex-realnode" \
    -o "$BIN/pause.tmp" "$pause_c"
  strip "$BIN/pause.tmp"
  mv "$BIN/pause.tmp" "$BIN/pause"
  echo "$pause_tag" > "$BIN/pause.tag"
  log "built pause $pause_tag (musl-gcc -static)"
fi

# --- Kubernetes node components -----------------------------------------------------
staging=$(sed -n 's#^\s*\(k8s\.io/[a-z0-9./-]*\) => \./staging/.*#\1#p' "$k8s_gomod")
[ -n "$staging" ] || { log "no staging replaces found in $k8s_gomod"; exit 1; }
edits=()
for m in $staging; do edits+=("-replace=$m=$m@$K8S_V0"); done
(cd "$K8S_MOD" && "$GO" mod edit "${edits[@]}")
k8s_ld="-X k8s.io/component-base/version.gitVersion=$K8S_VERSION"
k8s_ld+=" -X k8s.io/component-base/version.gitMajor=1"
k8s_ld+=" -X k8s.io/component-base/version.gitMinor=$(echo "$K8S_VERSION" | cut -d. -f2)"
k8s_ld+=" -X k8s.io/component-base/version.gitTreeState=clean"
# the flags (and cgo setting) of build.sh, so its Go build cache serves every shared package
for cmd in kubelet kube-scheduler kube-proxy; do
  [ -x "$BIN/$cmd" ] || build "$K8S_MOD" "$cmd" "k8s.io/kubernetes/cmd/$cmd" "$k8s_ld"
done

# --- containerd v2 ------------------------------------------------------------------
CTRD_MOD="$DIR/src/containerd"
new_module "$CTRD_MOD" containerd
(cd "$CTRD_MOD" && "$GO" mod edit -require="github.com/containerd/containerd/v2@$CONTAINERD_VERSION")
ctrd_ld="-X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION"
ctrd_ld+=" -X github.com/containerd/containerd/v2/version.Package=imex-realnode"
# no_btrfs: the btrfs snapshotter wants btrfs headers; overlayfs is the snapshotter used
for cmd in containerd containerd-shim-runc-v2 ctr; do
  [ -x "$BIN/$cmd" ] || CGO_ENABLED=0 build "$CTRD_MOD" "$cmd" \
    "github.com/containerd/containerd/v2/cmd/$cmd" "$ctrd_ld" "no_btrfs"
done

# --- runc (cgo: libcontainer/nsenter, libseccomp) -------------------------------------
RUNC_MOD="$DIR/src/runc"
new_module "$RUNC_MOD" runc
(cd "$RUNC_MOD" && "$GO" mod edit -require="github.com/opencontainers/runc@$RUNC_VERSION")
[ -x "$BIN/runc" ] || CGO_ENABLED=1 build "$RUNC_MOD" runc github.com/opencontainers/runc \
  "-X main.version=${RUNC_VERSION#v}" "seccomp urfave_cli_no_docs"

{
  echo "k8s.io/kubernetes $K8S_VERSION (kubelet, kube-scheduler, kube-proxy, build/pause $(cat "$BIN/pause.tag"))"
  echo "github.com/containerd/containerd/v2 $CONTAINERD_VERSION"
  echo "github.com/opencontainers/runc $RUNC_VERSION"
  echo "go $GO_VERSION"
} > "$STAMP"
echo "$BIN"
