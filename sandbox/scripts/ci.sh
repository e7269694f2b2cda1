#!/bin/sh
# Sandbox CI steps: install bubblewrap and debootstrap, build the base image
# (cached by tag: a no-op when already built), run the sandbox crate's unit
# tests and the isolation tests on both backends, and fail if any sandbox
# container is left behind. Not the whole project's CI (see .ci/run).
# Needs root (debootstrap, cgroups) and a running Docker daemon; the Debian
# mirror comes from the host's apt sources or $ARCTICD_DEBIAN_MIRROR.
set -eu
cd "$(dirname "$0")/../.."
if ! command -v bwrap >/dev/null || ! command -v debootstrap >/dev/null; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends bubblewrap debootstrap
fi
export CI="${CI:-1}"
cargo build --bin arcticd
./target/debug/arcticd sandbox build-image
cargo test -p arcticd-sandbox
cargo test --test sandbox_isolation
left=$(docker ps -a --filter label=arcticd.sandbox -q | wc -l)
if [ "$left" -ne 0 ]; then
    echo "sandbox containers left behind: $left" >&2
    docker ps -a --filter label=arcticd.sandbox >&2
    exit 1
fi
echo "sandbox CI: ok"
