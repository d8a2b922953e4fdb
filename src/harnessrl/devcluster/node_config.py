"""The real node's configuration files and in-cluster objects, as pure functions of its :class:`NodeLayout`.

Kept apart from the code that starts processes (:mod:`.node`) so each file can be read, and tested, as the
node gets it. The values that matter, and why:

- containerd 1.6: a private socket, state and CNI config folder, so a system containerd and podman's CNI
  config (``87-podman-bridge.conflist``, which containerd would load first by name) never interfere;
  ``restrict_oom_score_adj`` because these VMs lack ``CAP_SYS_RESOURCE`` (runc fails to lower the sandbox's
  ``oom_score_adj`` otherwise); an explicit ``runtime_type``, because a partial ``runtimes.runc`` table replaces
  the default one; the locally built pause image as the sandbox image (no registry here).
- kubelet: ``failCgroupV1: false`` (Kubernetes 1.35+ refuses cgroup v1 otherwise, and these machines mount the
  v1 hierarchy), the cgroupfs driver (no systemd), swap allowed, x509 client certificates only.
- CNI: a bridge with host-local IPAM and portmap; hairpin mode, so a pod reaches itself through a Service.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

POD_CIDR = "10.85.0.0/24"
CLUSTER_DNS_IP = "10.0.0.10"
CLUSTER_DOMAIN = "cluster.local"
BRIDGE = "hrl0"
PAUSE_IMAGE = "harnessrl.dev/pause:1"
COREDNS_IMAGE = "harnessrl.dev/coredns:1.15.0"
HELPER_IMAGE = "harnessrl.dev/busybox:1"
STORAGE_CLASS = "standard"  # kind's name for its default class, so specs written for kind work here
PROVISIONER = "rancher.io/local-path"
NODE_LABEL = ("harnessrl.dev/node", "real")


@dataclass(frozen=True)
class NodeLayout:
    """Where the node keeps what. ``state`` is removed by ``down``; ``cache`` (the image store) is kept."""

    name: str
    ip: str
    state: Path  # configs, certificates, kubelet root, volumes, logs
    run: Path  # sockets and runtime state (tmpfs)
    lib: Path  # kubelet's root: on disk (pods' emptyDirs) at a short path, since kubelet binds Unix sockets under
    # it (pod-resources/<random>) and a socket path has at most 107 bytes; a pytest tmp folder is longer
    cache: Path  # containerd's content and snapshots: images survive `down`, so a warm `up` imports none

    @property
    def containerd_socket(self) -> Path:
        return self.run / "containerd.sock"

    @property
    def containerd_root(self) -> Path:
        return self.cache / "containerd"

    @property
    def containerd_config(self) -> Path:
        return self.state / "containerd.toml"

    @property
    def cni_conf_dir(self) -> Path:
        return self.state / "cni"

    @property
    def kubelet_root(self) -> Path:
        return self.lib / "kubelet"

    @property
    def volumes(self) -> Path:
        return self.state / "volumes"

    @property
    def logs(self) -> Path:
        return self.state / "logs"


def containerd_config(layout: NodeLayout) -> str:
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{layout.containerd_root}"
state = "{layout.run / 'containerd'}"

[grpc]
  address = "{layout.containerd_socket}"

[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  enable_selinux = false

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false

[{cri}.cni]
  bin_dir = "/usr/lib/cni"
  conf_dir = "{layout.cni_conf_dir}"
"""


def cni_config(layout: NodeLayout) -> str:
    return json.dumps(
        {
            "cniVersion": "1.0.0",
            "name": "harnessrl",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    "ipMasq": True,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_CIDR}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(layout.run / "cni-ipam"),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        },
        indent=2,
    )


def kubelet_config(layout: NodeLayout, ca: Path, cert: Path, key: Path) -> dict:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{layout.containerd_socket}",
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(ca)},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "tlsCertFile": str(cert),
        "tlsPrivateKeyFile": str(key),
        "address": layout.ip,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "clusterDNS": [CLUSTER_DNS_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": "/etc/resolv.conf",
        "staticPodPath": "",
        "serializeImagePulls": False,
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        # Images come from the local import only, and nothing can pull them back: never garbage-collect them.
        # The thresholds stop routine GC; under disk pressure the eviction manager still deletes unused images
        # (seen: it removed the pause image and every image of a stopped workload), but only those older than
        # imageMinimumGCAge, so that is set beyond any run's length.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "imageMinimumGCAge": "87600h",
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "2%", "imagefs.available": "2%"},
        "podPidsLimit": -1,
        "maxPods": 110,
        "nodeStatusReportFrequency": "10s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "10s",
    }


def kube_proxy_config(layout: NodeLayout, kubeconfig: Path) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "mode": "iptables",
        "clusterCIDR": POD_CIDR,
        "hostnameOverride": layout.name,
        "bindAddress": "0.0.0.0",
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        # 0 leaves the conntrack sysctls as they are: a VM may not let us raise them.
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
    }


def local_path_config(layout: NodeLayout) -> str:
    return json.dumps(
        {"nodePathMap": [{"node": "DEFAULT_PATH_FOR_NON_LISTED_NODES", "paths": [str(layout.volumes)]}]}
    )


def helper_pod() -> dict:
    """The pod local-path-provisioner runs to make and remove a volume's folder (``/bin/sh /script/setup``)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "helper-pod"},
        "spec": {
            "priorityClassName": "system-node-critical",
            "tolerations": [{"key": "node.kubernetes.io/disk-pressure", "operator": "Exists"}],
            "containers": [{"name": "helper-pod", "image": HELPER_IMAGE, "imagePullPolicy": "Never"}],
        },
    }


def cluster_objects(layout: NodeLayout, provisioner_user: str, enforcer_user: str) -> list[dict]:
    """RBAC for the node's identities, CoreDNS (a Deployment with its ServiceAccount, as on kind) and the
    default StorageClass."""
    cluster_admin_for = [
        _binding(f"harnessrl:{user.split(':')[-1]}", "cluster-admin", {"kind": "User", "name": user})
        for user in (provisioner_user, enforcer_user)
    ]
    return [
        # The API server runs RBAC alone (no Node authorizer): nodes get their permissions from this role.
        _binding("harnessrl:nodes", "system:node", {"kind": "Group", "name": "system:nodes"}),
        *cluster_admin_for,
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "local-path-provisioner", "namespace": "kube-system"}},
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "local-path-config", "namespace": "kube-system"},
            "data": {
                "config.json": local_path_config(layout),
                "setup": 'set -eu\nmkdir -m 0777 -p "$VOL_DIR"\n',
                "teardown": 'set -eu\nrm -rf "$VOL_DIR"\n',
                "helperPod.yaml": json.dumps(helper_pod()),
            },
        },
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {
                "name": STORAGE_CLASS,
                "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
            },
            "provisioner": PROVISIONER,
            "volumeBindingMode": "WaitForFirstConsumer",
            "reclaimPolicy": "Delete",
        },
        *coredns_objects(),
    ]


def coredns_objects() -> list[dict]:
    labels = {"k8s-app": "kube-dns"}
    corefile = f""".:53 {{
    errors
    health :8080
    ready :8181
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 30
    }}
    forward . /etc/resolv.conf
    cache 30
    loadbalance
}}
"""
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "coredns", "namespace": "kube-system"}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "harnessrl:coredns"},
            "rules": [
                {"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"], "verbs": ["list", "watch"]},
                {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
            ],
        },
        _binding(
            "harnessrl:coredns",
            "harnessrl:coredns",
            {"kind": "ServiceAccount", "name": "coredns", "namespace": "kube-system"},
        ),
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "coredns", "namespace": "kube-system"},
            "data": {"Corefile": corefile},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "coredns", "namespace": "kube-system", "labels": labels},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "serviceAccountName": "coredns",
                        "priorityClassName": "system-cluster-critical",
                        "dnsPolicy": "Default",
                        # Port 53 in the pod, as on kind and managed clusters (NetworkPolicies name the pod's
                        # port), without root: a namespaced sysctl every kubelet allows.
                        "securityContext": {
                            "runAsNonRoot": True,
                            "runAsUser": 65532,
                            "runAsGroup": 65532,
                            "sysctls": [{"name": "net.ipv4.ip_unprivileged_port_start", "value": "0"}],
                        },
                        "containers": [
                            {
                                "name": "coredns",
                                "image": COREDNS_IMAGE,
                                "imagePullPolicy": "Never",
                                "args": ["-conf", "/etc/coredns/Corefile"],
                                "ports": [
                                    {"name": "dns", "containerPort": 53, "protocol": "UDP"},
                                    {"name": "dns-tcp", "containerPort": 53, "protocol": "TCP"},
                                ],
                                "readinessProbe": {"httpGet": {"path": "/ready", "port": 8181}, "periodSeconds": 2},
                                "livenessProbe": {"httpGet": {"path": "/health", "port": 8080}},
                                "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "170Mi"}},
                                "securityContext": {
                                    "readOnlyRootFilesystem": True,
                                    "allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]},
                                },
                                "volumeMounts": [{"name": "config", "mountPath": "/etc/coredns", "readOnly": True}],
                            }
                        ],
                        "volumes": [{"name": "config", "configMap": {"name": "coredns"}}],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": labels},
            "spec": {
                "selector": labels,
                "clusterIP": CLUSTER_DNS_IP,
                "ports": [
                    {"name": "dns", "port": 53, "targetPort": 53, "protocol": "UDP"},
                    {"name": "dns-tcp", "port": 53, "targetPort": 53, "protocol": "TCP"},
                ],
            },
        },
    ]


def _binding(name: str, role: str, subject: dict) -> dict:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [
            subject if subject["kind"] == "ServiceAccount" else {"apiGroup": "rbac.authorization.k8s.io", **subject}
        ],
    }
