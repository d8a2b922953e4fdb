"""``harnessrl run``: execute a TrainingRun on one machine.

The same spec the operator reconciles, with processes where the operator makes pods:
- the policy server: a vLLM process (CPU here, GPU where present), or ``--openai-base-url`` /
  ``spec.rollout.upstreams`` when one is already running;
- the capture proxy: one ``harnessrl proxy`` process in gateway mode. Each harness process still gets exactly
  a pod's contract (its own ``OPENAI_BASE_URL`` — the proxy's ``/rollouts/{id}/attempts/{n}/v1`` — its task file
  and the reward endpoint under that base URL); one shared process instead of one per harness saves a Python
  interpreter per rollout on a small machine;
- harness processes: started by the shared ``RolloutScheduler`` through ``ProcessBackend``;
- the learner: one ``harnessrl learn --spec`` process (DeepSpeed, a world of one on the CPU).

Everything durable is in the store, so stopping (Ctrl-C, a crash) and running the same command again
resumes: vLLM starts on the newest committed checkpoint, the learner continues from it, and rollouts it
already trained on are never trained on again.

Relative paths in the spec (model, tasks file, harness working directory) are resolved against the spec
file's directory, so an example directory is self-contained.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harnessrl.local.orphans import die_with_parent
from harnessrl.local.processes import ProcessBackend
from harnessrl.local.report import progress_line, summarize, summary_table, write_reward_curve, write_run_file
from harnessrl.local.stop_signals import StopSignals
from harnessrl.local.vllm_server import VllmServer, free_port, healthy, kill_process_group, start_vllm, tail
from harnessrl.policy_serving import SERVED_MODEL_NAME, continuity_flags, is_lora, lora_flags, served_model_name
from harnessrl.proxy.spec_env import spec_environment
from harnessrl.scheduler import Launch, RolloutScheduler, SchedulerSettings, evaluation_owed
from harnessrl.spec.evaluation import evaluation_sampling
from harnessrl.spec.harness import Tasks
from harnessrl.spec.kube import EnvVar
from harnessrl.spec.models import TrainingRun
from harnessrl.spec.scope import cluster_only_paths
from harnessrl.store import TraceStore
from harnessrl.store.learner_ledger import LearnerLedger

log = logging.getLogger(__name__)


class RunError(RuntimeError):
    """The run cannot start or continue; the message says what to do."""


@dataclass(frozen=True)
class LocalRunOptions:
    spec_path: Path
    run_dir: Path | None = None
    store_url: str | None = None
    openai_base_url: str | None = None
    model_dir: Path | None = None  # overrides spec.model.path
    steps: int | None = None  # overrides spec.learner.steps
    poll_s: float = 0.5
    live: bool = True  # a live progress display when stdout is a terminal


def load_tasks(run: TrainingRun, base: Path) -> list[dict[str, Any]]:
    """The run's tasks as JSON objects ({"id", "data", ...}), from the inline list or a JSONL file."""
    return read_tasks(run.spec.harness.tasks, base, "spec.harness.tasks")


def read_tasks(source: Tasks, base: Path, field: str) -> list[dict[str, Any]]:
    """Tasks from one source (harness.tasks or evaluation.tasks, named by ``field`` in every error)."""
    if source.inline is not None:
        return [task.model_dump(mode="json", by_alias=True, exclude_none=True) for task in source.inline]
    if source.file is not None:
        path = resolve(base, source.file.path)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise RunError(f"{field}.file.path: cannot read {path} ({exc.strerror})") from None
        tasks = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                task = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RunError(f"{path}:{number}: not JSON ({exc.msg}); each line must be one task object") from None
            if not isinstance(task, dict) or "id" not in task:
                raise RunError(f"{path}:{number}: a task must be a JSON object with an \"id\"")
            tasks.append(task)
        if not tasks:
            raise RunError(f"{path} has no tasks; add one JSON object per line")
        return tasks
    raise RunError(f"{field}.configMap is only available on a cluster; locally use file or inline")


def resolve(base: Path, value: str) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else (base / path).resolve()


class LocalRun:
    """One execution of ``harnessrl run``; ``execute()`` returns the process exit code."""

    def __init__(self, run: TrainingRun, options: LocalRunOptions) -> None:
        self.run = run
        self.options = options
        self.name = run.metadata.name
        self.spec = run.spec
        self.base = options.spec_path.resolve().parent
        self.run_dir = (options.run_dir or Path("runs") / self.name).resolve()
        self.steps = options.steps or self.spec.learner.steps
        self.store_url = options.store_url or self._store_url_from_spec()
        model = options.model_dir or (resolve(self.base, self.spec.model.path) if self.spec.model.path else None)
        if model is None or not (model / "config.json").is_file():
            hint = f"{model} has no config.json" if model else "spec.model.path is not set"
            raise RunError(f"spec.model.path: {hint}; locally the model must be a Hugging Face directory — build a "
                           f"tiny one with `harnessrl tiny-model DIR` and point spec.model.path (or --model) at it")
        self.model_dir = model
        self.tasks = load_tasks(run, self.base)
        evaluation = self.spec.evaluation
        self.evaluation_tasks = read_tasks(evaluation.tasks, self.base, "spec.evaluation.tasks") if evaluation else []
        # spec.harness.verifier: only the verifier processes get this token, which the proxy asks for on rewards
        self.reward_token = secrets.token_urlsafe(32) if self.spec.harness.verifier is not None else None
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._vllm: VllmServer | None = None  # the policy server this run started (None: an external one)
        self._external: str | None = None  # an external policy server's base URL, watched by its /health
        self._unhealthy = 0  # consecutive failed health checks of the external server

    def _store_url_from_spec(self) -> str:
        store = self.spec.store
        if store.postgres is not None:
            if store.postgres.url:
                return store.postgres.url
            raise RunError("spec.store.postgres.secretRef only works on a cluster; locally pass --store URL")
        path = store.sqlite.path if store.sqlite is not None else "trace.sqlite"
        target = Path(path) if Path(path).is_absolute() else self.run_dir / path
        return f"sqlite:///{target}"

    # --- the run ------------------------------------------------------------------------------------------

    def execute(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        store = TraceStore.connect(self.store_url)
        store.upgrade()
        store.ensure_run(self.name, self.run.model_dump(mode="json", by_alias=True, exclude_none=True))
        write_run_file(self.run_dir, self.name, self.store_url)
        ledger = LearnerLedger(store, self.name)
        lora = is_lora(self.spec)
        if not lora:  # a LoRA run's version 0 is the learner's fresh adapter, written and loaded by the learner
            ledger.ensure_base_version(str(self.model_dir))
        version = ledger.committed_version()
        done = ledger.committed_step()
        # Trained to the end: only a final evaluation round a stop interrupted is left to do (no learner then).
        evaluating_only = done >= self.steps
        if evaluating_only:
            final = store.latest_policy_version(self.name, synced_only=True) or 0
            if self.spec.evaluation is None or not evaluation_owed(store, self.name, final):
                self._report(store)
                print(f"run {self.name} already finished {done} steps; nothing to do")
                return 0
            print(f"run {self.name} finished its {done} steps, not its final evaluation: finishing that")
        committed = ledger.version(version)
        # vLLM starts on the base model under LoRA (the adapter is loaded into it), else on the newest weights
        serving = Path(committed.checkpoint_path) if version and not lora else self.model_dir
        with ExitStack() as stack:  # unwinds in reverse: harnesses, then learner and proxy, then vLLM
            upstream = self._upstream(stack, serving)
            stack.callback(self._stop_children)
            if lora and committed is not None:
                self._load_adapter(upstream, version, Path(committed.checkpoint_path))
            if committed is not None and not committed.synced:
                ledger.mark_synced(version)  # the server was just started on (or loaded) that very version
            proxy_url = self._start_proxy(upstream, version)
            verifier = self.spec.harness.verifier
            backend = ProcessBackend(
                self._harness_command(), self.run_dir, cwd=self._harness_cwd(),
                env=self._harness_env(), env_for=lambda launch: self._contract(proxy_url, launch),
                verifier=[*verifier.command, *verifier.args] if verifier else None,
                verifier_env_for=lambda launch: self._verifier_contract(proxy_url, launch),
            )
            stack.callback(backend.shutdown)
            scheduler = RolloutScheduler(store, SchedulerSettings.from_spec(self.name, self.spec), backend, self.tasks,
                                         evaluation_tasks=self.evaluation_tasks)
            stack.callback(scheduler.stop_all)
            learner = None if evaluating_only else self._start_learner(upstream, proxy_url)
            print(f"run {self.name}: store {self.store_url}, directory {self.run_dir}, serving v{version} "
                  f"from {serving}")
            cluster_only = cluster_only_paths(self.spec)
            if cluster_only:
                print(f"only on a cluster (this run leaves them alone): {', '.join(cluster_only)}")
            failure: RunError | None = None
            with StopSignals() as stop:
                try:
                    if learner is None:
                        self._finish_evaluation(store, scheduler, stop)
                    else:
                        self._loop(store, scheduler, learner, stop)
                except RunError as exc:  # a service died: stop the rest, show the summary, then the reason
                    failure = exc
            if stop.received is not None:
                print(f"\n{stop.received.name}: stopping harnesses, learner, proxy and vLLM (Ctrl-C again stops at "
                      "once); run the same command to resume", flush=True)
        code = self._children_exit_code("learner")
        self._report(store)
        store.close()
        if failure is not None:
            raise failure
        if stop.received is not None:
            return stop.exit_code
        return 0 if code == 0 or evaluating_only else 1

    def _loop(
        self, store: TraceStore, scheduler: RolloutScheduler, learner: subprocess.Popen[bytes], stop: StopSignals
    ) -> None:
        live = self.options.live and sys.stdout.isatty()
        last_line = ""
        started = time.monotonic()
        deadline = self.spec.active_deadline_seconds  # counted from this start: a resumed run gets it anew
        while stop.received is None:
            if deadline is not None and time.monotonic() - started > deadline:
                raise RunError(f"DeadlineExceeded: the run ran longer than spec.activeDeadlineSeconds={deadline} "
                               "— raise it or remove it, then run the same command to resume")
            version = store.latest_policy_version(self.name, synced_only=True)
            if version is not None:  # None: a LoRA run whose learner has not loaded version 0's adapter yet
                scheduler.reconcile(version)
            line = progress_line(summarize(store, self.name), self.steps)
            if live:
                print("\r" + line.ljust(len(last_line)), end="", flush=True)
            elif line != last_line:
                print(line, flush=True)
            last_line = line
            try:
                self._check_services()
            finally:
                if live and learner.poll() is not None:
                    print()
            if learner.poll() is not None:
                if learner.returncode == 0:
                    self._finish_evaluation(store, scheduler, stop)
                return
            time.sleep(self.options.poll_s)

    def _finish_evaluation(self, store: TraceStore, scheduler: RolloutScheduler, stop: StopSignals) -> None:
        """The learner made its last step: score the final version (and end a round under way) before the run
        stops, so the summary ends with the trained policy's evaluation. Ctrl-C stops it as it stops the loop."""
        if self.spec.evaluation is None:
            return
        version = store.latest_policy_version(self.name, synced_only=True) or 0
        print(f"training done: evaluating policy v{version} on spec.evaluation.tasks ...", flush=True)
        while stop.received is None:
            scheduler.reconcile(version, finishing=True)
            if not scheduler.evaluation_pending():
                return
            self._check_services()
            time.sleep(self.options.poll_s)

    # --- services -------------------------------------------------------------------------------------------

    def _upstream(self, stack: ExitStack, serving: Path) -> str:
        """Base URL (without /v1) of the policy server."""
        external = self.options.openai_base_url or (str(self.spec.rollout.upstreams[0])
                                                    if self.spec.rollout.upstreams else None)
        if external:
            base = external.rstrip("/").removesuffix("/v1")
            if not healthy(base):
                raise RunError(f"no healthy vLLM server at {base} (GET /health failed); start it or drop "
                               "--openai-base-url to let harnessrl start one")
            self._external = base
            return base
        print(f"starting vLLM on {serving} (log {self.run_dir / 'vllm.log'}) ...", flush=True)
        server: VllmServer = start_vllm(
            serving, self.run_dir / "vllm.log", served_name=served_model_name(self.spec),
            max_model_len=self.spec.rollout.max_model_len,
            extra_args=lora_flags(self.spec) + self.spec.rollout.args + continuity_flags(self.spec.rollout.args),
        )
        stack.callback(server.stop)
        self._vllm = server
        return server.base_url

    def _load_adapter(self, upstream: str, version: int, adapter: Path) -> None:
        """Resume a LoRA run: load the last committed adapter into the server under the policy's name and label
        the server with its version, before any harness runs (as the learner's weight sync does)."""
        from harnessrl.trainer.weight_sync import SyncError, VllmReplica

        replica = VllmReplica(upstream, lora_name=SERVED_MODEL_NAME, timeout_s=float(self.spec.weight_sync.timeout_seconds))
        try:
            replica.load(adapter, version)
            replica.set_version(version)
        except SyncError as exc:
            raise RunError(f"could not load version {version}'s adapter {adapter} into the policy server: {exc}") from None
        finally:
            replica.client.close()
        print(f"loaded version {version}'s adapter {adapter} as {SERVED_MODEL_NAME!r}", flush=True)

    def _start_proxy(self, upstream: str, version: int) -> str:
        port = free_port()
        rollout = self.spec.rollout
        sampling = {"temperature": rollout.temperature, "top_p": rollout.top_p}
        if rollout.max_tokens is not None:
            sampling["max_tokens"] = rollout.max_tokens
        command = [
            sys.executable, "-m", "harnessrl.cli", "proxy", "--upstream", upstream, "--store", self.store_url,
            "--port", str(port), "--run", self.name, "--model-name", SERVED_MODEL_NAME,
            "--sampling", json.dumps(sampling), "--policy-version", str(version),
        ]
        if self.spec.evaluation is not None:
            command += ["--evaluation-sampling", json.dumps(evaluation_sampling(self.spec.evaluation))]
        spool = resolve(self.run_dir, self.spec.proxy.spool_dir) / "proxy.spool"
        # Calls are recorded under the serving replica's weight label, as on a cluster (the learner's sync
        # labels each replica); the proxy's own version, set by the sync too, covers a replica without one.
        env = {**os.environ, **spec_environment(self.spec.proxy, spool), "HARNESSRL_REPLICA_VERSIONS": "true"}
        if self.reward_token is not None:
            # Not sandboxed here (one user, one machine): the token keeps a harness from reporting by
            # mistake; the pod on a cluster is what keeps the policy from forging it.
            env["HARNESSRL_REWARD_TOKEN"] = self.reward_token
        proc = self._spawn("proxy", command, env)
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            if proc.poll() is not None:
                raise RunError(f"the proxy exited with code {proc.returncode}:\n{tail(self.run_dir / 'proxy.log')}")
            if healthy(url, "/healthz"):
                return url
            time.sleep(0.1)
        raise RunError(f"the proxy did not become healthy; log {self.run_dir / 'proxy.log'}")

    def _start_learner(self, upstream: str, proxy_url: str) -> subprocess.Popen[bytes]:
        command = [
            sys.executable, "-m", "harnessrl.cli", "learn", "--spec", str(self.options.spec_path.resolve()),
            "--store", self.store_url, "--run", self.name, "--model", str(self.model_dir),
            "--output", str(resolve(self.run_dir, self.spec.learner.checkpoint_dir)), "--steps", str(self.steps),
            "--replica", upstream, "--proxy", proxy_url,
        ]
        return self._spawn("learner", command, dict(os.environ))

    def _spawn(self, name: str, command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(self.run_dir / f"{name}.log", "ab") as log:
            # Own session: Ctrl-C reaches only the runner, which stops the children in order.
            # cwd: the run directory, never a checkout root whose operator/ could shadow the stdlib's.
            proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.run_dir,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=die_with_parent())  # noqa: PLW1509 - safe, see orphans.py
        self._children[name] = proc
        return proc

    # An external server may miss a health check under load; this many misses in a row mean it is gone.
    EXTERNAL_HEALTH_MISSES = 3

    def _check_services(self) -> None:
        """Stop the run (RunError, exit 1) when a service it needs is gone, with that service's log tail.

        Without this a dead vLLM turns every harness call into a 502 and every rollout into a failure while
        the learner waits forever, and a learner that died leaves harnesses producing rollouts nobody trains
        on. A learner that exits 0 has finished its steps (the runner then stops the rest).
        """
        proxy = self._children.get("proxy")
        if proxy is not None and proxy.poll() is not None:
            raise RunError(f"the proxy exited with code {proxy.returncode}:\n{tail(self.run_dir / 'proxy.log')}")
        if self._vllm is not None and self._vllm.process is not None and self._vllm.process.poll() is not None:
            raise RunError(f"vLLM exited with code {self._vllm.process.returncode}; its log "
                           f"{self._vllm.log_path}:\n{tail(self._vllm.log_path, 30)}")
        if self._external is not None:
            self._unhealthy = 0 if healthy(self._external) else self._unhealthy + 1
            if self._unhealthy >= self.EXTERNAL_HEALTH_MISSES:
                raise RunError(f"the policy server at {self._external} stopped answering GET /health "
                               f"({self._unhealthy} checks in a row); restart it and run the same command to resume")
        learner = self._children.get("learner")
        if learner is not None and learner.poll() not in (None, 0):
            log_path = self.run_dir / "learner.log"
            raise RunError(f"the learner exited with code {learner.returncode} before the run's {self.steps} steps "
                           f"were done; its log {log_path}:\n{tail(log_path, 30)}")

    def _stop_children(self) -> None:
        # Learner first (it may be pausing the proxy), then the proxy (SIGTERM flushes its queue to the store).
        for name in ("learner", "proxy"):
            proc = self._children.get(name)
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    kill_process_group(proc, grace_s=1)

    def _children_exit_code(self, name: str) -> int | None:
        proc = self._children.get(name)
        return None if proc is None else proc.poll()

    # --- the harness contract ---------------------------------------------------------------------------------

    def _harness_command(self) -> list[str]:
        return [*self.spec.harness.command, *self.spec.harness.args]

    def _harness_cwd(self) -> Path:
        working = self.spec.harness.working_dir
        return resolve(self.base, working) if working else self.base

    def _harness_env(self) -> dict[str, str]:
        return self._local_env(self.spec.harness.env, "spec.harness.env")

    @staticmethod
    def _local_env(variables: list[EnvVar], field: str) -> dict[str, str]:
        env: dict[str, str] = {}
        for var in variables:
            if var.value is None:
                raise RunError(f"{field} {var.name}: valueFrom only works on a cluster; give a value")
            env[var.name] = var.value
        # The harness uses the runner's Python environment (`python` finds the same packages).
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        return env

    def _contract(self, proxy_url: str, launch: Launch) -> dict[str, str]:
        """With a verifier the harness gets no reward URL; the verifier gets it and the token
        (:meth:`_verifier_contract`)."""
        base = f"{proxy_url}/rollouts/{launch.rollout_id}/attempts/{launch.attempt}/v1"
        contract = {"OPENAI_BASE_URL": base, "OPENAI_API_KEY": "harnessrl", "HARNESSRL_MODEL_NAME": SERVED_MODEL_NAME}
        if self.reward_token is None:
            contract["HARNESSRL_REWARD_URL"] = f"{base}/reward"
        return contract

    def _verifier_contract(self, proxy_url: str, launch: Launch) -> dict[str, str]:
        base = f"{proxy_url}/rollouts/{launch.rollout_id}/attempts/{launch.attempt}/v1"
        verifier = self.spec.harness.verifier
        return {**self._local_env(verifier.env, "spec.harness.verifier.env"),
                "HARNESSRL_REWARD_URL": f"{base}/reward", "HARNESSRL_REWARD_TOKEN": self.reward_token}


    # --- the end ------------------------------------------------------------------------------------------------

    def _report(self, store: TraceStore) -> None:
        from rich.console import Console

        summary = summarize(store, self.name)
        Console().print(summary_table(summary))
        png = write_reward_curve(summary, self.run_dir / "reward.png")
        if png is not None:
            print(f"reward curve: {png}")

