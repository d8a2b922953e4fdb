"""A real node joined to the dev control plane: containerd + runc, kubelet, kube-proxy, CoreDNS, a dynamic
volume provisioner and a NetworkPolicy enforcer, so pods really run, on this machine.

kwok nodes only pretend: no container runs there. This node runs the project's images, pod specs, volumes and
policies for real. Only one fits a machine (kubelet's ports, the host's iptables, the ``/kubepods`` cgroups),
and it needs root. It is brought up as a list of small ordered steps, each with one job (as kind creates a
node): preflight, configs and certificates, containerd, the node's own images, kubelet, kube-proxy, the
in-cluster objects (RBAC, CoreDNS, the default StorageClass), the provisioner, the policy enforcer.

Choices, each measured on these machines:

- Host processes for kubelet, kube-proxy, the provisioner (local-path-provisioner, the one kind ships) and the
  policy enforcer, each with its own client certificate; CoreDNS runs in a pod with its ServiceAccount, so the
  in-cluster path (Service 10.0.0.1, a projected token) is exercised from the start.
- The policy enforcer is kube-router's firewall alone (``--run-router=false --run-service-proxy=false``):
  iptables and ipset, both in these kernels. ``sigs.k8s.io/kube-network-policies`` (kind's enforcer) sends
  packets to user space with nftables' ``queue`` statement, and these kernels are built without
  ``CONFIG_NFT_QUEUE``: its rules cannot be loaded. kube-router's reported flaws are in the parts left off.
- ``down`` (:func:`stop_node`) leaves no process, mount, network namespace, bridge or iptables chain, also
  after a failed start: pods are deleted through kubelet first (so CNI releases their addresses), then every
  component is stopped and anything left is removed directly.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from harnessrl.devcluster.apt import install_missing
from harnessrl.devcluster.build import Binaries, cache_root, ensure_node_binaries
from harnessrl.devcluster.containerd import ContainerdError, answers, private_containerd
from harnessrl.devcluster.node_config import (
    BRIDGE,
    COREDNS_IMAGE,
    HELPER_IMAGE,
    NODE_LABEL,
    PAUSE_IMAGE,
    PROVISIONER,
    NodeLayout,
    cluster_objects,
    cni_config,
    containerd_config,
    kube_proxy_config,
    kubelet_config,
)
from harnessrl.devcluster.node_images import NodeImage, write_oci_archive
from harnessrl.devcluster.pki import kubeconfig

NODE_NAME = "harnessrl-node"
NAMESPACE_K8S = "k8s.io"
PROVISIONER_USER = "harnessrl:local-path-provisioner"
ENFORCER_USER = "harnessrl:kube-router"
# Debian packages the node needs, by a file each installs.
PACKAGES = {
    "/usr/bin/containerd": "containerd",
    "/usr/sbin/runc": "runc",
    "/usr/lib/cni/bridge": "containernetworking-plugins",
    "/usr/sbin/iptables": "iptables",
    "/usr/sbin/conntrack": "conntrack",
    "/usr/sbin/ipset": "ipset",
    "/bin/busybox": "busybox-static",
}
# Chains the node's components create outside their own cleanup (kubelet's; CNI's portmap and masquerade).
_LEFTOVER_CHAIN = re.compile(r"^(KUBE-|CNI-)")


# One real node per machine, like its sockets under /run/harnessrl-node; removed by `down`.
LIB = Path("/var/lib/harnessrl-node")


class NodeError(RuntimeError):
    """The node cannot start; the message is one line naming what is missing or which component failed."""


def layout(cluster_dir: Path, ip: str, cache: Path) -> NodeLayout:
    return NodeLayout(
        name=NODE_NAME,
        ip=ip,
        state=cluster_dir / "node",
        run=Path("/run/harnessrl-node"),
        lib=LIB,
        cache=cache / "node",
    )


def node_ip() -> str:
    """The address of the interface the default route leaves by: pods reach the API server there."""
    out = subprocess.run(["ip", "-j", "route", "get", "1.1.1.1"], capture_output=True, text=True)
    try:
        return json.loads(out.stdout)[0]["prefsrc"]
    except (ValueError, IndexError, KeyError):
        raise NodeError(
            "real node: no IPv4 address on a default route (pods reach the API server at the node's address); "
            "add one, e.g. `ip addr add 192.0.2.2/24 dev eth0 && ip route add default dev eth0`"
        ) from None


def preflight(log: Callable[[str], None]) -> None:
    """Root, the kernel features the node uses, and the Debian packages it runs (installed when missing)."""
    if os.geteuid() != 0:
        raise NodeError("real node: needs root (kubelet, containerd and CNI change mounts, cgroups and iptables)")
    for path, what in (
        ("/sys/fs/cgroup/memory", "the memory cgroup controller"),
        ("/proc/sys/net/bridge/bridge-nf-call-iptables", "bridge netfilter (CONFIG_BRIDGE_NETFILTER)"),
        ("/proc/net/ip_tables_names", "iptables in the kernel (CONFIG_IP_NF_IPTABLES)"),
        ("/dev/kmsg", "/dev/kmsg (kubelet's OOM watcher)"),
    ):
        if not Path(path).exists() and not (path.endswith("memory") and Path("/sys/fs/cgroup/cgroup.controllers").exists()):
            raise NodeError(f"real node: this kernel lacks {what} ({path} is missing)")
    problem = install_missing(PACKAGES, "real node", log)
    if problem:
        raise NodeError(problem)
    Path("/proc/sys/net/bridge/bridge-nf-call-iptables").write_text("1")
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1")


def start_node(cluster, log: Callable[[str], None]) -> NodeLayout:
    """Join a real node to ``cluster`` (started with ``real_node=True``); its processes are recorded in the
    cluster's state, so :meth:`Cluster.stop` stops them. Raises :class:`NodeError`."""
    from harnessrl.devcluster.build import cache_root
    from harnessrl.devcluster.cluster import _start, _http_ok

    started = time.monotonic()
    binaries = ensure_node_binaries(log)
    node = layout(cluster.dir, cluster.node_ip, cache_root())
    cluster.node = {"name": node.name, "ip": node.ip, "state": str(node.state), "run": str(node.run),
                    "lib": str(node.lib), "cache": str(node.cache)}
    cluster.save()
    _clean_stale(node, log)
    for folder in (node.state, node.run, node.cni_conf_dir, node.kubelet_root, node.volumes, node.logs, node.cache):
        folder.mkdir(parents=True, exist_ok=True)
    files = _write_configs(cluster, node, binaries)

    _start(
        cluster,
        "containerd",
        ["--config", str(node.containerd_config)],
        lambda: answers(str(node.containerd_socket)),
        node.logs,
        attached=cluster.attached,
        binary=Path("/usr/bin/containerd"),
    )
    _import_node_images(node, binaries, log)
    cluster.kubectl("apply", "-f", "-", input=_yaml_stream(cluster_objects(node, PROVISIONER_USER, ENFORCER_USER)))
    _start(
        cluster,
        "kubelet",
        [
            f"--config={files['kubelet-config']}",
            f"--kubeconfig={files['kubelet.kubeconfig']}",
            f"--root-dir={node.kubelet_root}",
            f"--hostname-override={node.name}",
            f"--node-ip={node.ip}",
            f"--node-labels={NODE_LABEL[0]}={NODE_LABEL[1]}",
            "--v=1",
        ],
        lambda: _http_ok("http://127.0.0.1:10248/healthz"),
        node.logs,
        attached=cluster.attached,
        binary=binaries["kubelet"],
    )
    _start(
        cluster,
        "kube-proxy",
        [f"--config={files['kube-proxy-config']}", "--v=1"],
        lambda: _http_ok("http://127.0.0.1:10256/healthz"),
        node.logs,
        attached=cluster.attached,
        binary=binaries["kube-proxy"],
    )
    _wait_node_ready(cluster, node)
    _start(
        cluster,
        "local-path-provisioner",
        [
            "--debug",
            "start",
            f"--kubeconfig={files['provisioner.kubeconfig']}",
            f"--provisioner-name={PROVISIONER}",
            "--namespace=kube-system",
            "--service-account-name=local-path-provisioner",
            f"--helper-image={HELPER_IMAGE}",
            "--configmap-name=local-path-config",
        ],
        lambda: True,
        node.logs,
        attached=cluster.attached,
        binary=binaries["local-path-provisioner"],
        settle_s=1.0,
    )
    _start(
        cluster,
        "kube-router",
        [
            f"--kubeconfig={files['kube-router.kubeconfig']}",
            f"--hostname-override={node.name}",
            "--run-firewall=true",
            "--run-router=false",
            "--run-service-proxy=false",
            "--health-port=20244",
            "--metrics-port=0",
            "--v=1",
        ],
        lambda: _http_ok("http://127.0.0.1:20244/healthz"),
        node.logs,
        attached=cluster.attached,
        binary=binaries["kube-router"],
    )
    _wait_coredns(cluster)
    log(f"node: {node.name} Ready at {node.ip} in {time.monotonic() - started:.1f} s")
    return node


def _write_configs(cluster, node: NodeLayout, binaries: Binaries) -> dict[str, Path]:
    pki = cluster.pki
    files: dict[str, Path] = {}
    node.containerd_config.write_text(containerd_config(node))
    (node.cni_conf_dir / "10-harnessrl.conflist").write_text(cni_config(node))
    serving_cert, serving_key = pki.serving_certificate(f"kubelet-{node.name}", ips=(node.ip, "127.0.0.1"), dns=(node.name,))
    for name, user, groups in (
        ("kubelet", f"system:node:{node.name}", ("system:nodes",)),
        ("kube-proxy", "system:kube-proxy", ()),
        ("provisioner", PROVISIONER_USER, ()),
        ("kube-router", ENFORCER_USER, ()),
    ):
        cert, key = pki.client_certificate(user, groups)
        path = node.state / f"{name}.kubeconfig"
        # The node's components reach the API server at the node's own address, as pods do through the Service.
        path.write_text(yaml.safe_dump(kubeconfig(cluster.server_for_node, pki, user, cert, key)))
        files[f"{name}.kubeconfig"] = path
    files["kubelet-config"] = node.state / "kubelet-config.yaml"
    files["kubelet-config"].write_text(yaml.safe_dump(kubelet_config(node, pki.ca_cert, serving_cert, serving_key)))
    files["kube-proxy-config"] = node.state / "kube-proxy-config.yaml"
    files["kube-proxy-config"].write_text(yaml.safe_dump(kube_proxy_config(node, files["kube-proxy.kubeconfig"])))
    return files


def _node_images(binaries: Binaries) -> list[NodeImage]:
    busybox = Path("/bin/busybox")
    return [
        NodeImage(PAUSE_IMAGE, {"/pause": binaries["pause"]}, ("/pause",), {}),
        NodeImage(COREDNS_IMAGE, {"/coredns": binaries["coredns"]}, ("/coredns",), {}),
        NodeImage(
            HELPER_IMAGE,
            {"/bin/busybox": busybox},
            ("/bin/sh",),
            {f"/bin/{tool}": "busybox" for tool in ("sh", "mkdir", "rm", "ls", "cat", "sleep")},
            user="0:0",  # it makes and removes volume folders owned by root on the node
        ),
    ]


def _import_node_images(node: NodeLayout, binaries: Binaries, log: Callable[[str], None]) -> None:
    present = set(_ctr(node, "images", "ls", "-q").stdout.split())
    for image in _node_images(binaries):
        if image.ref in present:
            continue
        archive = write_oci_archive(image, node.state / "images" / f"{image.ref.split('/')[-1].replace(':', '-')}.tar")
        result = _ctr(node, "images", "import", str(archive))
        if result.returncode != 0:
            raise NodeError(f"node: importing {image.ref} failed: {result.stderr.strip()}")
        log(f"node: imported {image.ref}")


def _store_layout() -> NodeLayout:
    return layout(Path("/nonexistent"), "127.0.0.1", cache_root())  # no cluster: its state folder is unused


def running_image_store() -> str | None:
    """The socket of the real node's containerd when one is up and answers, else None."""
    socket = str(_store_layout().containerd_socket)
    return socket if answers(socket) else None


@contextmanager
def image_store(log: Callable[[str], None]) -> Iterator[str]:
    """The address of a containerd serving the node's image store (``cache``, kept across ``down``), for
    importing images before any node is up: the running node's containerd if there is one, else one started
    for the caller alone, on a private socket and state folder, and stopped afterwards.

    Why: the first import of the product's images (``podman save | ctr import``, about 13 GB) took 10 minutes of
    the first real-node test on a cold CI machine. Imported here, while the control plane still compiles, the
    node starts with every image present."""
    running = running_image_store()
    if running:
        yield running
        return
    node = _store_layout()
    if os.geteuid() != 0:
        raise NodeError("node image store: needs root (containerd's store belongs to root)")
    problem = install_missing(PACKAGES, "node image store", log)
    if problem:
        raise NodeError(problem)
    try:
        with private_containerd(node.containerd_root, "/usr/bin/containerd") as address:
            yield address
    except ContainerdError as error:
        raise NodeError(f"node image store: {error}") from None


def _ctr(node: NodeLayout, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ctr", "--address", str(node.containerd_socket), "-n", NAMESPACE_K8S, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _wait_node_ready(cluster, node: NodeLayout, timeout: float = 90) -> None:
    result = cluster.kubectl(
        "wait", "--for=condition=Ready", f"node/{node.name}", f"--timeout={timeout:.0f}s", check=False, timeout=timeout + 30
    )
    if result.returncode != 0:
        raise NodeError(
            f"node: kubelet did not make {node.name} Ready: {result.stderr.strip()}; log: {node.logs / 'kubelet.log'}"
        )


def _wait_coredns(cluster, timeout: float = 120) -> None:
    result = cluster.kubectl(
        "-n", "kube-system", "rollout", "status", "deployment/coredns", f"--timeout={timeout:.0f}s",
        check=False, timeout=timeout + 30,
    )
    if result.returncode != 0:
        pods = cluster.kubectl("-n", "kube-system", "get", "pods", "-o", "wide", check=False).stdout
        raise NodeError(f"node: CoreDNS did not become ready: {result.stderr.strip()}; pods: {pods.strip()}")


def _yaml_stream(objects: list[dict]) -> str:
    return "\n---\n".join(json.dumps(item) for item in objects)


# --- teardown -----------------------------------------------------------------------------------------------


def stop_node(cluster, log: Callable[[str], None] = print) -> list[str]:
    """Remove the node and everything it made; returns what had to be forced (empty on a clean stop)."""
    from harnessrl.devcluster.cluster import _terminate

    if not cluster.node:
        return []
    node = NodeLayout(
        name=cluster.node["name"],
        ip=cluster.node["ip"],
        state=Path(cluster.node["state"]),
        run=Path(cluster.node["run"]),
        lib=Path(cluster.node.get("lib", LIB)),
        cache=Path(cluster.node["cache"]),
    )
    forced: list[str] = []
    if cluster.running().get("kubelet") and cluster.running().get("kube-apiserver"):
        _drain(cluster, node)
    for name in ("kube-router", "local-path-provisioner", "kube-proxy", "kubelet"):
        if name in cluster.pids:
            _terminate(cluster.pids.pop(name), Path(cluster.exes.pop(name)))
    binaries = cluster.node_binaries
    if binaries is not None:
        subprocess.run([str(binaries["kube-proxy"]), "--cleanup"], capture_output=True)
        subprocess.run([str(binaries["kube-router"]), "--cleanup-config"], capture_output=True, timeout=60)
    forced += _remove_containers(node)
    if "containerd" in cluster.pids:
        _terminate(cluster.pids.pop("containerd"), Path(cluster.exes.pop("containerd")))
    forced += _kill_shims(node)
    forced += _unmount_under(node)
    forced += _remove_network(node)
    if cluster.running().get("kube-apiserver"):
        cluster.kubectl("delete", "node", node.name, "--ignore-not-found", "--wait=false", check=False)
    shutil.rmtree(node.run, ignore_errors=True)
    shutil.rmtree(node.lib, ignore_errors=True)
    cluster.node = None
    cluster.save()
    if forced:
        log(f"node: forced at teardown: {'; '.join(forced)}")
    return forced


def _clean_stale(node: NodeLayout, log: Callable[[str], None]) -> None:
    """A node left behind by a killed run (no cluster state to find it by) is cleared before a new start."""
    leftovers = _kill_shims(node) + _unmount_under(node) + _remove_network(node)
    if leftovers:
        log(f"node: cleared what an earlier node left: {'; '.join(leftovers)}")


def _drain(cluster, node: NodeLayout, timeout: float = 60) -> None:
    """Delete the node's pods through kubelet, so CNI releases their addresses and veths; workloads are
    deleted first so their controllers do not recreate them."""
    for kind in ("deployments", "statefulsets", "daemonsets", "jobs", "replicasets"):
        cluster.kubectl("delete", kind, "--all", "-A", "--wait=false", check=False)
    cluster.kubectl(
        "delete", "pods", "-A", "--grace-period=1", f"--field-selector=spec.nodeName={node.name}",
        f"--timeout={timeout:.0f}s", check=False, timeout=timeout + 30,
    )


def _remove_containers(node: NodeLayout) -> list[str]:
    if not answers(str(node.containerd_socket)):
        return []
    forced = []
    for task in _ctr(node, "tasks", "ls", "-q").stdout.split():
        _ctr(node, "tasks", "kill", "-s", "SIGKILL", task)
        _ctr(node, "tasks", "delete", "-f", task)
        forced.append(f"task {task[:12]}")
    for container in _ctr(node, "containers", "ls", "-q").stdout.split():
        _ctr(node, "containers", "rm", container)
    return forced


def _kill_shims(node: NodeLayout) -> list[str]:
    forced = []
    needle = str(node.containerd_socket).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"containerd-shim" in cmdline and needle in cmdline:
            try:
                os.kill(int(proc.name), 9)
                forced.append(f"shim {proc.name}")
            except ProcessLookupError:
                pass
    return forced


def _unmount_under(node: NodeLayout) -> list[str]:
    """Unmount what kubelet, containerd and CNI mounted under the node's folders and ``/run/netns``, deepest
    first (a pod's volumes sit under its own mounts)."""
    roots = (str(node.state), str(node.run), str(node.lib), str(node.cache), "/run/netns/cni-")
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    ours = sorted({m for m in mounts if m.startswith(roots)}, key=len, reverse=True)
    for mount in ours:
        subprocess.run(["umount", "-l", mount], capture_output=True)
    for netns in Path("/run/netns").glob("cni-*") if Path("/run/netns").is_dir() else ():
        netns.unlink(missing_ok=True)
    return [f"mount {m}" for m in ours]


def _remove_network(node: NodeLayout) -> list[str]:
    forced = []
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True)
        forced.append(f"bridge {BRIDGE}")
    for family in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle"):
            rules = subprocess.run([family, "-t", table, "-S"], capture_output=True, text=True).stdout.splitlines()
            chains = [r.split()[1] for r in rules if r.startswith("-N ") and _LEFTOVER_CHAIN.match(r.split()[1])]
            for rule in rules:  # jumps into our chains from the built-in ones first
                parts = shlex.split(rule)
                if parts[0] == "-A" and "-j" in parts and parts[parts.index("-j") + 1] in chains:
                    subprocess.run([family, "-t", table, "-D", *parts[1:]], capture_output=True)
            for chain in chains:
                subprocess.run([family, "-t", table, "-F", chain], capture_output=True)
            for chain in chains:
                subprocess.run([family, "-t", table, "-X", chain], capture_output=True)
                forced.append(f"{family} {table} {chain}")
    for ipset in _our_ipsets():  # kube-router's, once no rule refers to them
        subprocess.run(["ipset", "destroy", ipset], capture_output=True)
        forced.append(f"ipset {ipset}")
    return forced


def _our_ipsets() -> list[str]:
    names = subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True).stdout.split()
    return [name for name in names if name.startswith(("KUBE-", "kube-router"))]


def leftovers(node_state: Path | None = None) -> list[str]:
    """What a node could leave behind on this machine: our processes, mounts, network namespaces, the bridge
    and KUBE-/CNI- iptables chains (empty after a clean ``down``); for tests and ``kube.sh status``."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if b"/run/harnessrl-node" in cmdline or str(LIB).encode() in cmdline or (node_state and str(node_state).encode() in cmdline):
                text = cmdline.replace(b"\0", b" ")[:120].decode(errors="replace")
                found.append(f"process {proc.name}: {text}")
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    found += [f"mount {m}" for m in mounts if m.startswith(("/run/harnessrl-node", str(LIB), "/run/netns/cni-"))
              or (node_state and m.startswith(str(node_state)))]
    if Path("/run/netns").is_dir():
        found += [f"netns {p.name}" for p in Path("/run/netns").glob("cni-*")]
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        found.append(f"bridge {BRIDGE}")
    for family in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle"):
            rules = subprocess.run([family, "-t", table, "-S"], capture_output=True, text=True).stdout.splitlines()
            found += [f"{family} {table} chain {r.split()[1]}" for r in rules
                      if r.startswith("-N ") and (_LEFTOVER_CHAIN.match(r.split()[1]) or "KUBE-ROUTER" in r)]
    found += [f"ipset {name}" for name in _our_ipsets()]
    return found
