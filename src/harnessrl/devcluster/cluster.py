"""Start, check and stop the control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and
kwok as processes on 127.0.0.1, with a private PKI and an admin kubeconfig.

Each component is started only after the one it needs answers its readiness endpoint; a component that exits
or does not become ready stops the start with one line naming it and its log, and everything already started
is stopped. Every process is recorded by PID in ``cluster.json`` in the cluster folder, which is how ``down``
(another process, e.g. ``scripts/kube.sh down``) finds and stops them. A cluster started for tests
(``attached=True``) also asks the kernel to SIGTERM its processes when the test process dies, so an
interrupted or killed test run leaves nothing behind.

The flags follow controller-runtime's envtest, plus what a machine without a default route needs
(``--advertise-address`` and no endpoint reconciler) and what this project tests: RBAC on, the default
admission plugins (service accounts included) except ``TaintNodesByCondition``, whose not-ready taint only the
node-lifecycle controller would remove (it is off: kwok nodes have no kubelet heartbeat to judge).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from harnessrl.devcluster.build import Binaries, ensure_binaries
from harnessrl.devcluster.kwok import NODE_LABEL, STAGES_FILE, fake_node
from harnessrl.devcluster.pki import Pki, kubeconfig, make_pki
from harnessrl.local.orphans import die_with_parent

STATE_FILE = "cluster.json"
START_TIMEOUT_S = 90.0
SERVICE_CIDR = "10.0.0.0/24"
SERVICE_IP = "10.0.0.1"  # the `kubernetes` Service: the first address of SERVICE_CIDR
_SERVICE_SUFFIXES = ("", ".default", ".default.svc", ".default.svc.cluster.local")
POD_CIDR = "10.244.0.0/16"


class ClusterError(RuntimeError):
    """The cluster could not start (or stop); the message is one line naming the component and its log."""


class KubectlError(subprocess.CalledProcessError):
    """kubectl failed; unlike its base class, the message carries what kubectl said."""

    def __str__(self) -> str:
        return f"kubectl {' '.join(self.cmd[3:])} exited with {self.returncode}: {self.stderr.strip()}"


@dataclass
class Cluster:
    """A running control plane. ``kubeconfig`` is the admin's (``system:masters``)."""

    dir: Path
    server: str
    binaries: Binaries
    pids: dict[str, int] = field(default_factory=dict)
    etcd_data: Path | None = None
    exes: dict[str, str] = field(default_factory=dict)  # name -> executable, to tell our PIDs from reused ones
    node: dict | None = None  # the real node's layout (harnessrl.devcluster.node), when one was joined
    node_ip: str = "127.0.0.1"  # the address pods and the node's components reach the API server at
    attached: bool = True

    @property
    def server_for_node(self) -> str:
        """The API server's URL at the node's address (what kubelet, kube-proxy and pods use)."""
        return f"https://{self.node_ip}:{self.server.rsplit(':', 1)[1]}"

    @property
    def node_binaries(self) -> Binaries | None:
        return Binaries(Path(self.exes["kubelet"]).parents[1]) if "kubelet" in self.exes else None

    @property
    def pki(self) -> Pki:
        return Pki(self.dir / "pki")

    @property
    def audit_log(self) -> Path:
        """The API server's audit log (JSON lines), written when the cluster was started with audit_users."""
        return self.dir / "logs" / "audit.log"

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "admin.kubeconfig"

    def env(self) -> dict[str, str]:
        """Environment for clients: KUBECONFIG and the built kubectl first on PATH."""
        return {
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": f"{self.binaries['kubectl'].parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        kubeconfig_path: Path | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        """Run the cluster's own kubectl; ``check`` raises with kubectl's stderr on a non-zero exit."""
        command = [
            str(self.binaries["kubectl"]),
            "--kubeconfig",
            str(kubeconfig_path or self.kubeconfig),
            *args,
        ]
        result = subprocess.run(command, input=input, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, command, result.stdout, result.stderr)
        return result

    def apply_crd(self, path: Path, timeout: float = 60.0) -> None:
        """Apply a CRD file and wait until the API server serves it. Polled rather than ``kubectl wait
        --for=condition=Established``, which fails instead of waiting while a new CRD has no conditions yet
        (seen on a loaded machine: ".status.conditions accessor error: <nil>")."""
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
        name = yaml.safe_load(path.read_text())["metadata"]["name"]
        query = "jsonpath={.status.conditions[?(@.type=='Established')].status}"
        deadline = time.monotonic() + timeout
        while self.kubectl("get", "crd", name, "-o", query, check=False).stdout.strip() != "True":
            if time.monotonic() > deadline:
                raise ClusterError(f"CRD {name} not Established after {timeout:.0f} s")
            time.sleep(0.1)

    def user_kubeconfig(self, user: str, groups: Sequence[str] = ()) -> Path:
        """A kubeconfig that authenticates as ``user`` (client certificate), for testing RBAC for real."""
        cert, key = self.pki.client_certificate(user, tuple(groups))
        path = self.dir / f"{user}.kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig(self.server, self.pki, user, cert, key)))
        return path

    def running(self) -> dict[str, bool]:
        return {name: _alive(pid, self.executable(name)) for name, pid in self.pids.items()}

    def executable(self, name: str) -> Path:
        return Path(self.exes[name]) if name in self.exes else self.binaries[name]

    def stop(self, remove: bool = True) -> None:
        """Stop every process (SIGTERM, then SIGKILL after a grace period) and remove the cluster's files.
        A real node goes first, while the API server can still delete its pods through kubelet."""
        if self.node:
            from harnessrl.devcluster.node import stop_node

            stop_node(self)
        for name in reversed(list(self.pids)):
            _terminate(self.pids[name], self.executable(name))
        self.pids.clear()
        if self.etcd_data is not None:
            shutil.rmtree(self.etcd_data, ignore_errors=True)
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            self.save()

    def save(self) -> None:
        (self.dir / STATE_FILE).write_text(
            json.dumps(
                {
                    "server": self.server,
                    "binaries": str(self.binaries.dir),
                    "pids": self.pids,
                    "etcd_data": str(self.etcd_data) if self.etcd_data else None,
                    "exes": self.exes,
                    "node": self.node,
                    "node_ip": self.node_ip,
                    "attached": self.attached,
                },
                indent=2,
            )
        )

    @classmethod
    def load(cls, directory: Path) -> Cluster:
        try:
            state = json.loads((directory / STATE_FILE).read_text())
        except (OSError, ValueError) as exc:
            raise ClusterError(f"no cluster recorded in {directory} ({exc.__class__.__name__})") from None
        return cls(
            directory,
            state["server"],
            Binaries(Path(state["binaries"])),
            dict(state["pids"]),
            Path(state["etcd_data"]) if state["etcd_data"] else None,
            dict(state.get("exes", {})),
            state.get("node"),
            state.get("node_ip", "127.0.0.1"),
            state.get("attached", False),
        )


def start_cluster(
    directory: Path | None = None,
    *,
    nodes: int = 3,
    port: int | None = None,
    attached: bool = True,
    benchmark: bool = False,
    audit_users: Sequence[str] = (),
    real_node: bool = False,
    log: Callable[[str], None] = print,
) -> Cluster:
    """Build (once) and start a control plane; raises :class:`ClusterError` with nothing left running.

    ``attached``: the processes die with this process (tests). ``benchmark``: lift the API server's
    in-flight limits and priority-and-fairness, so a benchmark measures the operator, not the throttle.
    ``audit_users``: log the metadata of these users' requests to :attr:`Cluster.audit_log`.
    ``real_node``: join a real node (:mod:`.node`; needs root): the API server then listens on every address
    and advertises the node's, so pods reach it through the ``kubernetes`` Service.
    """
    if real_node:  # before any build: without root or a kernel feature, nothing else is worth doing
        from harnessrl.devcluster.node import preflight

        preflight(log)
    binaries = ensure_binaries(log)
    directory = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="harnessrl-kube-"))
    directory.mkdir(parents=True, exist_ok=True)
    shm = Path("/dev/shm")
    etcd_data = Path(tempfile.mkdtemp(prefix="harnessrl-etcd-", dir=shm if shm.is_dir() else None))
    cluster = Cluster(directory, "", binaries, etcd_data=etcd_data, attached=attached)
    if real_node:
        from harnessrl.devcluster.node import node_ip

        cluster.node_ip = node_ip()
        pki = make_pki(
            directory / "pki",
            serving_ips=(cluster.node_ip, SERVICE_IP),
            serving_dns=tuple(f"kubernetes{suffix}" for suffix in _SERVICE_SUFFIXES),
        )
    else:
        pki = make_pki(directory / "pki")
    logs = directory / "logs"
    logs.mkdir(exist_ok=True)
    started = time.monotonic()
    try:
        etcd_port, peer_port = _free_port(), _free_port()
        api_port = port or _free_port()
        cluster.server = f"https://127.0.0.1:{api_port}"
        admin_cert, admin_key = pki.client_certificate("admin", ("system:masters",))
        cluster.kubeconfig.write_text(
            yaml.safe_dump(kubeconfig(cluster.server, pki, "admin", admin_cert, admin_key))
        )
        admin = str(cluster.kubeconfig)

        _start(
            cluster,
            "etcd",
            [
                "--name=default",
                f"--data-dir={etcd_data}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
            lambda: _http_ok(f"http://127.0.0.1:{etcd_port}/health"),
            logs,
            attached,
        )

        apiserver = [
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            f"--secure-port={api_port}",
            f"--tls-cert-file={pki.serving_cert}",
            f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_cert}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.service_account_pub}",
            f"--service-account-signing-key-file={pki.service_account_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=RBAC",
            "--allow-privileged=true",
            "--disable-admission-plugins=TaintNodesByCondition",
            f"--cert-dir={directory / 'apiserver-certs'}",
        ]
        if real_node:
            # Pods reach the API server through the `kubernetes` Service, whose endpoint is the advertised
            # address (kept by the endpoint reconciler); `kubectl logs/exec` dial kubelet at the node's IP.
            kubelet_cert, kubelet_key = pki.client_certificate("kube-apiserver-kubelet-client", ("system:masters",))
            apiserver += [
                "--bind-address=0.0.0.0",
                f"--advertise-address={cluster.node_ip}",
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                f"--kubelet-client-certificate={kubelet_cert}",
                f"--kubelet-client-key={kubelet_key}",
                f"--kubelet-certificate-authority={pki.ca_cert}",
            ]
        else:
            # No default route needed: nothing but local clients talk to it.
            apiserver += [
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                "--endpoint-reconciler-type=none",
            ]
        if audit_users:
            # Metadata of every request these users make, one JSON line each: how a benchmark counts one
            # client's requests by verb (apiserver_request_total has no client label).
            policy = directory / "audit-policy.yaml"
            policy.write_text(
                yaml.safe_dump(
                    {
                        "apiVersion": "audit.k8s.io/v1",
                        "kind": "Policy",
                        "omitStages": ["RequestReceived"],
                        "rules": [{"level": "Metadata", "users": list(audit_users)}, {"level": "None"}],
                    }
                )
            )
            apiserver += [
                f"--audit-policy-file={policy}",
                f"--audit-log-path={cluster.audit_log}",
                "--audit-log-format=json",
            ]
        if benchmark:
            apiserver += [
                "--max-requests-inflight=0",
                "--max-mutating-requests-inflight=0",
                "--enable-priority-and-fairness=false",
            ]
        _start(
            cluster,
            "kube-apiserver",
            apiserver,
            lambda: _https_ok(f"{cluster.server}/readyz", pki, admin_cert, admin_key),
            logs,
            attached,
        )

        kcm_port, scheduler_port, kwok_port = _free_port(), _free_port(), _free_port()
        serving = [
            f"--tls-cert-file={pki.serving_cert}",
            f"--tls-private-key-file={pki.serving_key}",
            f"--authentication-kubeconfig={admin}",
            f"--authorization-kubeconfig={admin}",
            "--bind-address=127.0.0.1",
        ]
        _start(
            cluster,
            "kube-controller-manager",
            [
                f"--kubeconfig={admin}",
                *serving,
                f"--secure-port={kcm_port}",
                "--leader-elect=false",
                "--controllers=*,-node-lifecycle-controller",
                "--use-service-account-credentials=false",
                f"--service-account-private-key-file={pki.service_account_key}",
                f"--root-ca-file={pki.ca_cert}",
                f"--cluster-signing-cert-file={pki.ca_cert}",
                f"--cluster-signing-key-file={pki.ca_key}",
                "--kube-api-qps=500",
                "--kube-api-burst=1000",
                "--concurrent-job-syncs=20",
                "--concurrent-gc-syncs=40",
            ],
            lambda: _https_ok(f"https://127.0.0.1:{kcm_port}/healthz", pki),
            logs,
            attached,
        )

        scheduler_config = directory / "scheduler.yaml"
        scheduler_config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kubescheduler.config.k8s.io/v1",
                    "kind": "KubeSchedulerConfiguration",
                    "clientConnection": {"kubeconfig": admin, "qps": 500, "burst": 1000},
                    "leaderElection": {"leaderElect": False},
                }
            )
        )
        _start(
            cluster,
            "kube-scheduler",
            [
                f"--config={scheduler_config}",
                *serving,
                f"--secure-port={scheduler_port}",
            ],
            lambda: _https_ok(f"https://127.0.0.1:{scheduler_port}/healthz", pki),
            logs,
            attached,
        )

        stages = directory / "kwok-stages.yaml"
        stages.write_text(binaries.node_stages.read_text() + "\n---\n" + STAGES_FILE.read_text())
        _start(
            cluster,
            "kwok",
            [
                f"--kubeconfig={admin}",
                f"--config={stages}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-label-selector={NODE_LABEL[0]}={NODE_LABEL[1]}",
                f"--server-address=127.0.0.1:{kwok_port}",
                f"--cidr={POD_CIDR}",
                "--node-ip=10.240.0.1",
            ],
            lambda: _http_ok(f"http://127.0.0.1:{kwok_port}/healthz"),
            logs,
            attached,
        )

        if nodes:
            _add_nodes(cluster, nodes)
        _wait_for_default_service_account(cluster)
        if real_node:
            from harnessrl.devcluster.node import start_node

            start_node(cluster, log)
    except BaseException:
        cluster.stop(remove=False)
        raise
    cluster.save()
    log(
        f"kube: cluster up in {time.monotonic() - started:.1f} s at {cluster.server} "
        f"(KUBECONFIG={cluster.kubeconfig})"
    )
    return cluster


def _start(
    cluster: Cluster,
    name: str,
    args: list[str],
    ready: Callable[[], bool],
    logs: Path,
    attached: bool,
    binary: Path | None = None,
    settle_s: float = 0.0,
) -> None:
    """Start one component and wait until ``ready()``; ``settle_s``: for a component without a readiness
    endpoint, how long it must stay up to count as started."""
    log_path = logs / f"{name}.log"
    binary = binary or cluster.binaries[name]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [str(binary), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=cluster.dir,
            preexec_fn=die_with_parent() if attached else None,  # noqa: PLW1509 - safe, see orphans.py
        )
    cluster.pids[name] = proc.pid
    cluster.exes[name] = str(binary)
    cluster.save()
    if settle_s:
        time.sleep(settle_s)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise ClusterError(
                f"{name} exited with code {code} while starting: {_last_line(log_path)}; log: {log_path}"
            )
        if ready():
            return
        time.sleep(0.2)
    raise ClusterError(
        f"{name} not ready after {START_TIMEOUT_S:.0f} s: {_last_line(log_path)}; log: {log_path}"
    )


def _add_nodes(cluster: Cluster, count: int) -> None:
    manifest = "\n---\n".join(json.dumps(fake_node(f"kwok-node-{index}")) for index in range(count))
    cluster.kubectl("apply", "-f", "-", input=manifest)
    result = cluster.kubectl(
        "wait",
        "--for=condition=Ready",
        "node",
        "-l",
        f"{NODE_LABEL[0]}={NODE_LABEL[1]}",
        f"--timeout={START_TIMEOUT_S:.0f}s",
        check=False,
        timeout=START_TIMEOUT_S + 10,
    )
    if result.returncode != 0:
        raise ClusterError(
            f"kwok did not make the fake nodes Ready: {result.stderr.strip()}; "
            f"log: {cluster.dir / 'logs' / 'kwok.log'}"
        )


def _wait_for_default_service_account(cluster: Cluster) -> None:
    """Pods are refused until their namespace's ``default`` ServiceAccount exists (the controller manager
    creates it); waiting here means the first test does not race it."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if cluster.kubectl("get", "serviceaccount", "default", "-n", "default", check=False).returncode == 0:
            return
        time.sleep(0.2)
    raise ClusterError(
        "kube-controller-manager created no default ServiceAccount; "
        f"log: {cluster.dir / 'logs' / 'kube-controller-manager.log'}"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _https_ok(url: str, pki: Pki, cert: Path | None = None, key: Path | None = None) -> bool:
    context = ssl.create_default_context(cafile=str(pki.ca_cert))
    if cert is not None:
        context.load_cert_chain(str(cert), str(key))
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][:400] if lines else "(no output)"


def _alive(pid: int, binary: Path) -> bool:
    """True when ``pid`` is still one of our processes (a PID reused by another program is not)."""
    try:
        return Path(f"/proc/{pid}/exe").resolve() == binary.resolve()
    except OSError:
        return False


def _terminate(pid: int, binary: Path, grace_s: float = 10.0) -> None:
    if not _alive(pid, binary):
        _reap(pid)
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)  # each component leads its own session and process group
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            _reap(pid)
            if not _alive(pid, binary):
                return
            time.sleep(0.05)
    if _alive(pid, binary):
        raise ClusterError(f"process {pid} ({binary.name}) survived SIGKILL")


def _reap(pid: int) -> None:
    """Collect the exit status of our own child, so it does not linger as a zombie (other processes' are
    reaped by their parent)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
