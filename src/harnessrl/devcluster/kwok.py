"""kwok's part: fake nodes, and pod stages that play the kubelet's pod lifecycle.

kwok runs no containers; its Stage documents say how a pod's status moves. These stages make every pod
scheduled to a fake node Running (native sidecars running, other init containers completed) and leave it
there, unless annotations on the pod say otherwise — so a test or benchmark chooses each pod's fate:

- ``kwok.harnessrl.io/run-for: "3s"`` — the main containers exit that long after the pod is Running
  (a Go duration);
- ``kwok.harnessrl.io/exit-code: "2"`` — with ``run-for``: they exit with this code and the pod is Failed
  (reason ``Error``, or ``kwok.harnessrl.io/reason``); without it they exit 0 and the pod Succeeded;
- ``kwok.harnessrl.io/waiting-reason: ImagePullBackOff`` — the pod never starts: it stays Pending with its
  containers waiting for that reason, as the kubelet reports a bad image or a missing Secret;
- a first container with the image ``kwok.invalid/image-pull-backoff`` does the same with ImagePullBackOff
  (for pods whose annotations a test does not write, e.g. pods an operator creates);
- harness pods (``harnessrl.io/component=harness``) in the namespace ``harnessrl-bench`` end on their own,
  exit 0, 1 to 5 s after they run (kwok's jitter): the operator benchmark's harnesses, which nobody plays.

A pod being deleted is removed at once (there is no kubelet to confirm it). Nodes take kwok's own
``node-initialize`` stage (copied from its module when it is built) and become Ready. The stages are in
``kwok-pod-stages.yaml`` beside this file; each one's selector excludes the others', so a pod matches at most
one stage at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

RUN_FOR = "kwok.harnessrl.io/run-for"
EXIT_CODE = "kwok.harnessrl.io/exit-code"
REASON = "kwok.harnessrl.io/reason"
WAITING_REASON = "kwok.harnessrl.io/waiting-reason"
IMAGE_PULL_BACKOFF_IMAGE = "kwok.invalid/image-pull-backoff"
BENCH_NAMESPACE = "harnessrl-bench"
NODE_LABEL = ("type", "kwok")

STAGES_FILE = Path(__file__).with_name("kwok-pod-stages.yaml")


def fake_node(name: str, gpus: int = 8) -> dict[str, Any]:
    """A Node for kwok to manage: large enough for any test, with GPUs so GPU pods schedule too."""
    capacity = {
        "cpu": "64",
        "memory": "512Gi",
        "pods": "1000",
        "nvidia.com/gpu": str(gpus),
        "ephemeral-storage": "1Ti",
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                NODE_LABEL[0]: NODE_LABEL[1],
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
            },
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "status": {"capacity": capacity, "allocatable": capacity},
    }
