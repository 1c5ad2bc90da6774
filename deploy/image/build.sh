#!/usr/bin/env bash
# `make image`: build Containerfile with buildah — as root, chroot isolation, so neither a
# container engine nor a daemon is needed — and tag it $IMAGE.
#
# The base (BASE_IMAGE), in this order:
#   1. BASE_IMAGE when set;
#   2. the official Python slim image, when it is in buildah's storage or its registry
#      hands it over;
#   3. else a base made here from Debian's packages: debootstrap of bookworm (Debian's
#      python3 is 3.11) from the mirror apt already uses, with what the final stage needs,
#      kept in buildah's storage under a tag that names its recipe — made once, reused.
#
# Variables: IMAGE (default localhost/stovepipe:<version>), BASE_IMAGE, DEBIAN_MIRROR.
set -euo pipefail
cd "$(dirname "$0")/../.."

OFFICIAL_BASE=docker.io/library/python:3.11-slim-bookworm
SUITE=bookworm
# beside minbase: the interpreter, venv, and what the final stage otherwise installs
DEBIAN_PACKAGES=python3,python3-venv,ca-certificates,git,openssh-client,tini
RECIPE=1  # raise when the base's recipe changes in a way its tag does not show

say() { printf 'make image: %s\n' "$*" >&2; }
fail() { say "$*"; exit 1; }

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)
IMAGE=${IMAGE:-localhost/stovepipe:$version}

has_image() { buildah inspect --type image "$1" >/dev/null 2>&1; }

apt_mirror() {
    # the Debian archive apt reads here: a deb822 .sources file, else a one-line list
    local uri
    uri=$(sed -n 's/^URIs:[[:space:]]*//p' /etc/apt/sources.list.d/*.sources 2>/dev/null \
          | tr ' ' '\n' | grep -E '/debian/?$' | head -n1 || true)
    if [[ -z $uri ]]; then
        uri=$(awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^(https?|file):/) { print $i; break } }' \
              /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
              | grep -E '/debian/?$' | head -n1 || true)
    fi
    echo "${uri:-http://deb.debian.org/debian}"
}

debian_base() {
    local mirror tag root ctr
    mirror=${DEBIAN_MIRROR:-$(apt_mirror)}
    tag="localhost/stovepipe-base:$SUITE-$(echo "$SUITE $DEBIAN_PACKAGES $mirror $RECIPE" \
         | sha256sum | cut -c1-12)"
    if has_image "$tag"; then
        say "no registry: reusing the base $tag"
        echo "$tag"
        return
    fi
    command -v debootstrap >/dev/null || fail "debootstrap is missing: apt-get install -y debootstrap"
    say "no registry: making a base from Debian's packages ($SUITE from $mirror, a few minutes)"
    root=$(mktemp -d /var/tmp/stovepipe-base.XXXXXX)
    trap 'rm -rf "$root"' RETURN
    debootstrap --variant=minbase --include="$DEBIAN_PACKAGES" "$SUITE" "$root" "$mirror" \
        > "$root.log" 2>&1 || fail "debootstrap failed: see $root.log"
    rm -f "$root.log"
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb
    # (podman's `import` would take the tarball; buildah fills a scratch container)
    ctr=$(buildah from scratch)
    tar -C "$root" --numeric-owner -c . | tar -C "$(buildah mount "$ctr")" --numeric-owner -xp
    buildah umount "$ctr" >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env LANG=C.UTF-8 --cmd python3 \
        --label "org.opencontainers.image.description=Debian $SUITE minbase with $DEBIAN_PACKAGES from $mirror" \
        "$ctr"
    buildah commit --quiet --rm "$ctr" "$tag" >/dev/null
    say "made the base $tag"
    echo "$tag"
}

command -v buildah >/dev/null || fail "buildah is missing: apt-get install -y buildah"
[[ $(id -u) == 0 ]] || fail "buildah's chroot isolation needs root here (or set up rootless buildah)"

if [[ -z ${BASE_IMAGE:-} ]]; then
    if has_image "$OFFICIAL_BASE" || timeout 60 buildah pull --quiet "$OFFICIAL_BASE" >/dev/null 2>&1; then
        BASE_IMAGE=$OFFICIAL_BASE
    else
        BASE_IMAGE=$(debian_base)
    fi
fi

# Each RUN step trusts what this machine trusts (say, a TLS-inspecting proxy's CA, for
# pip): the host's CA bundle is mounted over the base's while the step runs, never copied.
trust=()
if [[ -s /etc/ssl/certs/ca-certificates.crt ]]; then
    trust=(--volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
fi
previous=$(buildah images --noheading --no-trunc --format '{{.ID}}' "$IMAGE" 2>/dev/null || true)
say "building $IMAGE on $BASE_IMAGE"
buildah bud --isolation chroot --layers --force-rm --quiet "${trust[@]}" \
    --build-arg "BASE_IMAGE=$BASE_IMAGE" \
    --label "org.opencontainers.image.version=$version" \
    --label "org.opencontainers.image.revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)" \
    -f Containerfile -t "$IMAGE" . >/dev/null
current=$(buildah images --noheading --no-trunc --format '{{.ID}}' "$IMAGE")
# the image the tag named before is dropped (its layers stay while the build cache uses them)
if [[ -n $previous && $previous != "$current" ]]; then
    buildah rmi "$previous" >/dev/null 2>&1 || true
fi
say "built $IMAGE ($(buildah images --noheading --format '{{.Size}}' "$IMAGE"))"
