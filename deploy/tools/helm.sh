#!/usr/bin/env bash
# Print the path of the pinned helm, building it first when it is not there yet: helm is
# not among Debian's packages, so it is built from its Go module (the Go module proxy
# serves it) into a cache shared by every checkout on this machine — about 3 minutes on 2
# cores the first time, nothing after. HELM=/path/to/helm uses that one instead.
#
# Variables: HELM, STOVEPIPE_TOOLS (the cache; default ~/.cache/stovepipe/tools).
set -euo pipefail

HELM_MODULE=helm.sh/helm/v4
HELM_VERSION=v4.3.2

if [[ -n ${HELM:-} ]]; then
    echo "$HELM"
    exit 0
fi
tools=${STOVEPIPE_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/stovepipe/tools}
target="$tools/helm-$HELM_VERSION/helm"
if [[ -x $target ]]; then
    echo "$target"
    exit 0
fi
command -v go >/dev/null || {
    echo "helm.sh: go is missing (Go >= 1.24 builds helm $HELM_VERSION)" >&2; exit 1; }
mkdir -p "$tools"
exec 9>"$tools/helm-$HELM_VERSION.lock"
flock 9  # one build at a time; a waiter finds the binary made by the other
if [[ ! -x $target ]]; then
    echo "helm.sh: building helm $HELM_VERSION from $HELM_MODULE (once; a few minutes)" >&2
    staging=$(mktemp -d "$tools/.helm-build.XXXXXX")
    trap 'rm -rf "$staging"' EXIT
    CGO_ENABLED=0 GOBIN="$staging" GOFLAGS=-buildvcs=false \
        go install "$HELM_MODULE/cmd/helm@$HELM_VERSION" >&2
    mkdir -p "$(dirname "$target")"
    mv "$staging/helm" "$target"
fi
echo "$target"
