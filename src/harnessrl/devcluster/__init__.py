"""A real Kubernetes control plane on this machine, for the tests and benchmarks.

The operator, the CRD and its CEL rules, the webhook, RBAC and the chart are checked against a real
kube-apiserver, the way controller-runtime's envtest and kwok-based scale tests do it: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler run as plain processes on 127.0.0.1, and kwok plays the kubelet of
a few fake nodes. Nothing is downloaded from release sites: the binaries are built once from Go modules
(`scripts/kube/*/go.mod`) and cached under ``~/.cache/harnessrl/``.

- :mod:`.build` builds and caches the binaries;
- :mod:`.pki` makes the private CA, serving and client certificates and the admin kubeconfig;
- :mod:`.kwok` holds the pod and node stages that make fake pods run, succeed and fail;
- :mod:`.cluster` starts, checks and stops the processes;
- ``scripts/kube.sh build|up|down|env|status`` is the command line for people
  (``python -m harnessrl.devcluster``).

It lives in the package (not under ``tests/``) so tests, ``bench/`` and the command line share one
implementation; it needs the repository checkout for the Go modules.
"""

from harnessrl.devcluster.build import Binaries, BuildError, ensure_binaries
from harnessrl.devcluster.cluster import Cluster, ClusterError, start_cluster

__all__ = ["Binaries", "BuildError", "Cluster", "ClusterError", "ensure_binaries", "start_cluster"]
