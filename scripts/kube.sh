#!/usr/bin/env bash
# A real Kubernetes control plane on 127.0.0.1 for tests, benchmarks and people:
#   scripts/kube.sh build     build etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl
#                             and kwok from Go modules once (cached under ~/.cache/harnessrl)
#   scripts/kube.sh up        start a cluster (3 kwok nodes; --real-node: a real kubelet node); prints KUBECONFIG
#   scripts/kube.sh env       eval "$(scripts/kube.sh env)" points kubectl at it
#   scripts/kube.sh status    each component's PID and state
#   scripts/kube.sh images    build the images in images/ (podman; cached) and import them into a real node
#   scripts/kube.sh down      stop it
# Needs the venv (scripts/setup.sh test) and Go 1.26 or later. The implementation is harnessrl.devcluster.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
[ -x "$root/.venv/bin/python" ] || { echo "kube: no .venv here; run scripts/setup.sh test first" >&2; exit 1; }
# Not from the repository root: `python -m` there would import the root's operator/ folder as the stdlib's.
cd / && exec "$root/.venv/bin/python" -m harnessrl.devcluster "$@"
