"""Operator at scale: one TrainingRun of N rollouts at concurrency C on the real control plane with kwok nodes.

The operator runs as its own process (`harnessrl operator`, as in the chart) with a user of its own, so the API
server's audit log counts exactly its requests. kwok ends each harness pod 1 to 5 s after it runs (the
`harnessrl-bench` namespace's stage); nobody reports rewards, so every rollout ends as NoReward — the outcome
does not matter here, only how fast the operator turns free slots into running pods and what it costs.

Printed:
- rollouts finished per second over the run;
- API requests per finished rollout by verb: the operator's own (audit log) and every client's together
  (the API server's apiserver_request_total: the scheduler's bindings, kwok's status updates, ...);
- operator CPU ms per rollout and its RSS when 10% and 100% of the rollouts had finished;
- pod start: creation -> harness running (p50/p95), and free slot -> next pod running (p95: the k-th pod
  created once all slots were busy is matched with the k-th pod that ended).

    python bench/operator_scale.py                      # 2,000 rollouts at concurrency 200
    python bench/operator_scale.py --rollouts 400 --concurrency 40   # a quick run

The last line is for scripts: api_requests_per_rollout=<x> operator_cpu_ms_per_rollout=<y>
operator_mem_mib_200=<a> operator_mem_mib_2000=<b> pod_start_p95_s=<c> (200 and 2000 are 10% and 100% of
--rollouts; the names keep the issue's defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from store_write import add_pg_option, fresh_pg_database  # noqa: E402

from harnessrl.devcluster import Cluster, start_cluster  # noqa: E402
from harnessrl.devcluster.kwok import BENCH_NAMESPACE  # noqa: E402
from harnessrl.local.vllm_server import free_port  # noqa: E402
from harnessrl.store import TraceStore  # noqa: E402

OPERATOR_USER = "harnessrl-operator"
RUN = "scale"
GROUP = 8


def training_run(store_url: str, rollouts: int, concurrency: int) -> dict:
    groups = -(-rollouts // GROUP)
    return {
        "apiVersion": "harnessrl.io/v1alpha1",
        "kind": "TrainingRun",
        "metadata": {"name": RUN},
        "spec": {
            "model": {"path": "/models/m"},
            # No vLLM Deployment: nothing calls it here, and a run whose vLLM the operator runs needs a shared
            # checkpoint claim this cluster has no provisioner for.
            "rollout": {"upstreams": ["http://127.0.0.1:9/v1"]},
            "harness": {
                "image": "example.invalid/harness:1",
                "command": ["harness"],
                "tasks": {"inline": [{"id": f"t{i}"} for i in range(16)]},
                "groupSize": GROUP,
                "concurrency": concurrency,
                "timeoutSeconds": 600,
                "maxAttempts": 1,
            },
            # No learner consumes groups here: the staleness bound must allow every group of the run at once.
            "learner": {"steps": 1000, "tasksPerStep": groups, "maxStaleness": 0},
            "store": {"postgres": {"url": store_url}},
        },
    }


def apiserver_requests(kube: Cluster) -> Counter[str]:
    """apiserver_request_total summed by verb (every client)."""
    import ssl
    import urllib.request

    cert, key = kube.pki.client_certificate("admin", ("system:masters",))
    context = ssl.create_default_context(cafile=str(kube.pki.ca_cert))
    context.load_cert_chain(str(cert), str(key))
    with urllib.request.urlopen(f"{kube.server}/metrics", context=context, timeout=30) as resp:
        text = resp.read().decode()
    totals: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith("apiserver_request_total{"):
            labels, value = line.rsplit(" ", 1)
            verb = labels.split('verb="', 1)[1].split('"', 1)[0]
            totals[verb] += float(value)
    return totals


def operator_requests(kube: Cluster) -> Counter[str]:
    verbs: Counter[str] = Counter()
    for line in kube.audit_log.read_text().splitlines():
        event = json.loads(line)
        if event.get("user", {}).get("username") == OPERATOR_USER:
            verbs[event["verb"]] += 1
    return verbs


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--pods-per-second", type=float, default=100.0, help="the operator's creation bound")
    add_pg_option(parser)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="harnessrl-bench-"))
    kube = start_cluster(work / "kube", benchmark=True, audit_users=[OPERATOR_USER], log=lambda line: None)
    try:
        with fresh_pg_database(args.pg) as store_url:
            run(kube, store_url, args, work)
    finally:
        kube.stop()


def run(kube: Cluster, store_url: str, args: argparse.Namespace, work: Path) -> None:
    kube.apply_crd(ROOT / "crds" / "trainingruns.harnessrl.io.yaml")
    kube.kubectl("create", "namespace", BENCH_NAMESPACE)
    kube.kubectl("create", "clusterrolebinding", "bench-operator", "--clusterrole=cluster-admin",
                 f"--user={OPERATOR_USER}")
    env = {**os.environ, "KUBECONFIG": str(kube.user_kubeconfig(OPERATOR_USER)),
           "HARNESSRL_OPERATOR_POD_CREATES_PER_SECOND": str(args.pods_per_second)}
    log = open(work / "operator.log", "wb")
    # Free ports: with port 0 in its URL kopf's liveness server binds port 80 (taken by anything else there).
    metrics_port, liveness_port = free_port(), free_port()
    operator = subprocess.Popen(
        [str(Path(sys.executable).parent / "harnessrl"), "operator", "--namespace", BENCH_NAMESPACE,
         "--metrics-port", str(metrics_port), "--liveness", f"http://127.0.0.1:{liveness_port}/healthz"],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd="/",
    )
    store = TraceStore.connect(store_url)
    try:
        time.sleep(3)
        requests_before = apiserver_requests(kube)
        cpu_before = cpu_seconds(operator.pid)
        machine_before = machine_cpu(kube)
        doc = training_run(store_url, args.rollouts, args.concurrency)
        kube.kubectl("apply", "-n", BENCH_NAMESPACE, "-f", "-", input=json.dumps(doc))
        started = time.monotonic()
        first_finish = last_finish = None
        mem_early = None
        early = max(1, args.rollouts // 10)
        clock = PodClock(kube)
        clock.start()
        while True:
            if operator.poll() is not None:
                raise SystemExit(f"the operator exited with {operator.returncode}; log: {work / 'operator.log'}")
            counts = store.count_attempts(RUN) if _ready(store) else {}
            finished = sum(n for state, n in counts.items() if state.terminal)
            if finished and first_finish is None:
                first_finish = time.monotonic()
            if mem_early is None and finished >= early:
                mem_early = rss_mib(operator.pid)
            if finished >= args.rollouts:
                last_finish = time.monotonic()
                break
            if time.monotonic() - started > 1800:
                raise SystemExit(f"only {finished} of {args.rollouts} rollouts finished in 30 min")
            time.sleep(2)
        mem_late = rss_mib(operator.pid)
        cpu = cpu_seconds(operator.pid) - cpu_before
        machine = {name: seconds - machine_before.get(name, 0.0) for name, seconds in machine_cpu(kube).items()}
        total = apiserver_requests(kube)
        every_client = {verb: total[verb] - requests_before.get(verb, 0) for verb in total}
        own = operator_requests(kube)
        passes = reconcile_passes(metrics_port)
        clock.stopping = True
    finally:
        operator.terminate()
        operator.wait(30)
        log.close()
    rollouts = sum(n for state, n in store.count_attempts(RUN).items() if state.terminal)
    store.close()
    elapsed = last_finish - started
    per_rollout_own = {verb: n / rollouts for verb, n in sorted(own.items())}
    per_rollout_all = {verb: n / rollouts for verb, n in sorted(every_client.items()) if n}
    pod_times = [tuple(times) for times in clock.times.values()]
    starts = [run_at - created for created, run_at, _ in pod_times if run_at is not None]
    slot = _slot_latencies(pod_times, args.concurrency)
    print(f"{rollouts} rollouts at concurrency {args.concurrency} in {elapsed:.0f} s: "
          f"{rollouts / elapsed:.1f} rollouts/s (pods end 1-5 s after they run: at most "
          f"{args.concurrency / 3:.0f}/s on average)")
    print("operator API requests per rollout: " + ", ".join(f"{v} {n:.2f}" for v, n in per_rollout_own.items())
          + f" (total {sum(per_rollout_own.values()):.2f})")
    print("all clients' API requests per rollout: "
          + ", ".join(f"{v} {n:.2f}" for v, n in per_rollout_all.items())
          + f" (total {sum(per_rollout_all.values()):.2f})")
    print(f"operator CPU per rollout: {1000 * cpu / rollouts:.1f} ms (one core at that cost finishes at most "
          f"{rollouts / cpu:.0f} rollouts/s; this run needs about {args.concurrency / 3:.0f}/s); RSS "
          f"{mem_early:.0f} MiB at {early} finished, {mem_late:.0f} MiB at {rollouts}")
    others = sum(machine.values())
    cores = os.cpu_count() or 1
    print("the rest of the machine's CPU per rollout: "
          + ", ".join(f"{name} {1000 * seconds / rollouts:.1f} ms" for name, seconds in sorted(machine.items()))
          + f" (total {1000 * others / rollouts:.1f} ms: with the operator's, {cores} cores sustain at most "
          f"{cores * rollouts / (others + cpu):.0f} rollouts/s)")
    count, seconds, slow = passes
    print(f"operator reconcile passes: {count:.0f}, mean {1000 * seconds / max(count, 1):.0f} ms, "
          f"{slow / max(count, 1):.0%} over 1 s")
    created = _slot_latencies(pod_times, args.concurrency, to=0)
    print(f"pod creation -> running: p50 {percentile(starts, 0.5):.2f} s, p95 {percentile(starts, 0.95):.2f} s; "
          f"free slot -> running: p95 {percentile(slot, 0.95):.2f} s ({len(slot)} slots); free slot -> pod "
          f"created (the operator's part): p50 {percentile(created, 0.5):.2f} s, p95 {percentile(created, 0.95):.2f} s")
    print(f"api_requests_per_rollout={sum(per_rollout_own.values()):.2f} "
          f"operator_cpu_ms_per_rollout={1000 * cpu / rollouts:.1f} operator_mem_mib_200={mem_early:.0f} "
          f"operator_mem_mib_2000={mem_late:.0f} pod_start_p95_s={percentile(slot, 0.95):.2f}")


def reconcile_passes(metrics_port: int) -> tuple[float, float, float]:
    """(passes, seconds in them, passes over 1 s) from the operator's own harnessrl_operator_reconcile_seconds."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("harnessrl_operator_reconcile_seconds") and f'run="{RUN}"' in line:
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0].rsplit("_", 1)[-1] + ('+1.0' if 'le="1.0"' in name else "")
            values[key] = values.get(key, 0.0) + float(value)
    count = values.get("count", 0.0)
    return count, values.get("sum", 0.0), count - values.get("bucket+1.0", count)


def _ready(store: TraceStore) -> bool:
    try:
        store.count_attempts(RUN)
        return True
    except Exception:  # noqa: BLE001 - the operator has not migrated the store yet
        return False


class PodClock(threading.Thread):
    """Watches the harness pods and notes, by its own clock, when each was created, ran and ended: API
    timestamps have one-second resolution, too coarse for start latencies of a second or two."""

    def __init__(self, kube: Cluster) -> None:
        super().__init__(daemon=True)
        from kubernetes import client, config

        self.api = client.CoreV1Api(config.new_client_from_config(config_file=str(kube.kubeconfig)))
        self.times: dict[str, list[float | None]] = {}
        self.stopping = False

    def run(self) -> None:
        from kubernetes import watch

        while not self.stopping:
            try:
                self._follow(watch.Watch().stream(self.api.list_namespaced_pod, BENCH_NAMESPACE,
                                                  timeout_seconds=30, label_selector="harnessrl.io/component=harness"))
            except Exception:  # noqa: BLE001 - a watch cut by the server or by the end of the run: watch again
                time.sleep(0.1)

    def _follow(self, stream) -> None:
        for event in stream:
            now = time.time()
            pod = event["object"]
            times = self.times.setdefault(pod.metadata.name, [now, None, None])
            phase = pod.status.phase if pod.status else None
            if phase == "Running" and times[1] is None:
                times[1] = now
            if phase in ("Succeeded", "Failed") and times[2] is None:
                times[2] = now
                times[1] = times[1] or now
            if self.stopping:
                return


def _slot_latencies(
    pods: list[tuple[float, float | None, float | None]], concurrency: int, to: int = 1
) -> list[float]:
    """After the first `concurrency` pods, each new pod took a slot a pod's end freed: the k-th later pod is
    matched with the k-th end (FIFO), and its latency is from that end to its own start (``to=1``) or to its
    creation (``to=0``: what the operator controls; creation -> running is the scheduler's and kwok's)."""
    by_creation = sorted(pods, key=lambda p: p[0])
    ends = sorted(p[2] for p in by_creation if p[2] is not None)
    later = [p for p in by_creation[concurrency:] if p[to] is not None]
    return [max(0.0, pod[to] - end) for pod, end in zip(later, ends)]


def machine_cpu(kube: Cluster) -> dict[str, float]:
    """CPU seconds so far of the control plane's processes, of every PostgreSQL process (the store's server,
    shared with whatever else uses it) and of this script (its pod watch): what shares the cores with the
    operator."""
    seconds = {name: cpu_seconds(pid) for name, pid in kube.pids.items() if Path(f"/proc/{pid}").exists()}
    seconds["postgres"] = 0.0
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (proc / "comm").read_text().strip() == "postgres":
                    seconds["postgres"] += cpu_seconds(int(proc.name))
            except OSError:  # gone meanwhile
                continue
    seconds["bench"] = cpu_seconds(os.getpid())
    return seconds


if __name__ == "__main__":
    main()
