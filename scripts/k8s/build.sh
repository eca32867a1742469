#!/bin/sh
# Kubernetes v1.20.2 for the test cluster (tests/harness/k8s/), built once per machine.
#
# Debian bookworm's own source package is the only complete Kubernetes to be had here (no
# prebuilt control plane in Debian, PyPI or npm; trixie's is kubectl-only). It is built with
# Debian's Go, with no network: CGO_ENABLED=0 GOPROXY=off, GOFLAGS unset (-mod=vendor breaks
# upstream's make), the version given by KUBE_GIT_* as there is no git tree. One change: the
# vendored modern-go/reflect2 1.0.1 (and json-iterator with it) breaks under Go >= 1.18, and the
# apiserver dies with SIGSEGV on its first node status PATCH, about 2 min after start; Debian's
# packaged 1.0.2 / 1.1.12 replace them. About 4.5 min on 2 cores, 2.8 GB of disk while it runs.
#
# The five binaries are cached in $K8S_CACHE/bin (default ~/.cache/skytasks/k8s-v1.20.2/bin),
# written to a temporary folder beside it and renamed into place: an interrupted build leaves no
# half cache, and the next run starts over. Also installs (apt) what the cluster runs on.
# Root, as on the dev and CI machines.
set -eu
{ # One block, read whole before it runs: a sh reads a script as it goes, and an edit made to
  # it during the build would otherwise run from the middle of the new text.
VERSION=v1.20.2
CACHE=${K8S_CACHE:-${HOME:-/root}/.cache/skytasks/k8s-$VERSION}
BINARIES="kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl"
# The pods' sandbox process: sleeps until SIGTERM or SIGINT (a pid 1 ignores signals it has no
# handler for), and reaps any orphan given to it. Static, so an image of just this file runs.
PAUSE_GO='package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	c := make(chan os.Signal, 8)
	signal.Notify(c, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range c {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			if pid, _ := syscall.Wait4(-1, nil, syscall.WNOHANG, nil); pid <= 0 {
				break
			}
		}
	}
}
'
RUNTIME="etcd-server containerd runc containernetworking-plugins socat openssl iproute2 util-linux"
BUILD="dpkg-dev golang-go make rsync golang-github-modern-go-reflect2-dev golang-github-json-iterator-go-dev"

have_bins() { for b in $BINARIES pause; do test -x "$CACHE/bin/$b" || return 1; done; }
build_pause() {  # into $1
	d=$(mktemp -d) && printf '%s' "$PAUSE_GO" > "$d/pause.go" &&
		(cd "$d" && env -u GOFLAGS CGO_ENABLED=0 GOPROXY=off GO111MODULE=off GOCACHE="$d/cache" \
			go build -ldflags=-s -o "$1" pause.go) && rm -rf "$d"
}
have_runtime() {
	for t in etcd containerd containerd-shim-runc-v2 runc ctr socat openssl ip unshare nsenter; do
		command -v $t >/dev/null || return 1
	done
	test -x /usr/lib/cni/bridge && test -x /usr/lib/cni/host-local && test -x /usr/lib/cni/loopback
}
install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null; }

updated=
if ! have_runtime; then
	apt-get update -qq; updated=1
	install $RUNTIME
fi
have_bins && exit 0
if test -x "$CACHE/bin/kube-apiserver" && ! test -x "$CACHE/bin/pause"; then  # a cache from before pause
	command -v go >/dev/null || { test -n "$updated" || apt-get update -qq; install golang-go; }
	build_pause "$CACHE/bin/pause.tmp" && mv "$CACHE/bin/pause.tmp" "$CACHE/bin/pause"
	have_bins && exit 0
fi

echo "building Kubernetes $VERSION into $CACHE/bin (once per machine, about 5 min)" >&2
# The source needs a deb-src entry for bookworm (and its security suite, where the package is).
if ! grep -rqs '^Types:.*deb-src' /etc/apt/sources.list.d/ && ! grep -qs '^deb-src ' /etc/apt/sources.list; then
	cat > /etc/apt/sources.list.d/skytasks-deb-src.sources <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
	updated=
fi
test -n "$updated" || apt-get update -qq
install $BUILD

mkdir -p "$CACHE"
work=$(mktemp -d "$CACHE/build.XXXXXX")
trap 'rm -rf "$work"' EXIT
trap 'exit 1' INT TERM HUP
cd "$work"
apt-get source -qq kubernetes >/dev/null 2>&1 || apt-get source kubernetes
src=$(find . -maxdepth 1 -type d -name 'kubernetes-*' | head -n1)
cd "$src"

# Debian's reflect2 and json-iterator over the vendored ones (their non-test .go and .s files).
for pkg in github.com/modern-go/reflect2 github.com/json-iterator/go; do
	from=/usr/share/gocode/src/$pkg
	test -d "$from" || { echo "missing $from" >&2; exit 1; }
	rm -f vendor/$pkg/*.go vendor/$pkg/*.s
	for f in "$from"/*.go "$from"/*.s; do
		case $f in *_test.go) ;; *) test ! -e "$f" || cp "$f" vendor/$pkg/ ;; esac
	done
done

unset GOFLAGS GOPATH GO111MODULE
export CGO_ENABLED=0 GOPROXY=off GOCACHE="$work/gocache" KUBE_GIT_VERSION=$VERSION \
	KUBE_GIT_COMMIT=faecb196815e248d3ecfb03c680a4507229c2a56 KUBE_GIT_TREE_STATE=clean \
	KUBE_GIT_MAJOR=1 KUBE_GIT_MINOR=20
make WHAT="cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler cmd/kubelet cmd/kubectl" >&2

mkdir "$work/bin"
for b in $BINARIES; do cp "_output/bin/$b" "$work/bin/"; done
build_pause "$work/bin/pause"
"$work/bin/kube-apiserver" --version >&2
rm -rf "$CACHE/bin"
mv "$work/bin" "$CACHE/bin"
echo "Kubernetes $VERSION binaries in $CACHE/bin" >&2
exit 0
}
