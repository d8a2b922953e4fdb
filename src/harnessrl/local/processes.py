"""Harness runs as local processes: the local runner's ``RolloutBackend``.

A process gets the same contract as a harness pod (DESIGN.md §4): its task as JSON in a file and in an env
variable, ``OPENAI_BASE_URL`` of its own proxy, and its attribution in ``HARNESSRL_*`` variables. Each run gets
its own session (process group) so a timeout kills the harness and everything it spawned.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from harnessrl.local.orphans import die_with_parent
from harnessrl.scheduler import HarnessExit, Launch
from harnessrl.task_contract import task_fits_in_env


@dataclass
class _Running:
    process: subprocess.Popen[bytes]
    log: IO[bytes]
    directory: Path
    launch: Launch
    stop_reason: str | None = None
    verifying: bool = False  # the harness exited 0 and ``process`` is now the verifier


class ProcessBackend:
    """Starts one process per rollout attempt in ``workdir/rollouts/<rollout>-a<attempt>/``."""

    def __init__(
        self,
        command: Sequence[str],
        workdir: Path,
        *,
        env: Mapping[str, str] | None = None,
        env_for: Callable[[Launch], Mapping[str, str]] | None = None,
        cwd: Path | None = None,
        kill_grace_s: float = 5.0,
        verifier: Sequence[str] | None = None,
        verifier_env_for: Callable[[Launch], Mapping[str, str]] | None = None,
    ) -> None:
        if not command:
            raise ValueError("harness.command is empty: give the command that starts one harness run")
        self.command = list(command)
        self.workdir = Path(workdir)
        self.env = dict(env or {})
        self.env_for = env_for
        self.cwd = cwd
        self.kill_grace_s = kill_grace_s
        # spec.harness.verifier: started in the attempt's directory (HARNESSRL_WORKSPACE, which the harness
        # gets too) once the harness exited 0; its exit is the attempt's. A harness that fails is not verified.
        self.verifier = list(verifier) if verifier else None
        self.verifier_env_for = verifier_env_for
        self._runs: dict[tuple[str, int], _Running] = {}

    def launch_budget(self) -> None:
        return None  # a process starts in milliseconds; concurrency alone bounds them

    def launch(self, launch: Launch) -> None:
        key = (launch.rollout_id, launch.attempt)
        if key in self._runs:
            return
        directory = self.workdir / "rollouts" / f"{launch.rollout_id}-a{launch.attempt}"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "task.json").write_text(json.dumps(launch.task))
        env = {**os.environ, **self.env, **self._attempt_env(launch, directory),
               **(self.env_for(launch) if self.env_for else {})}
        log = (directory / "harness.log").open("ab")
        process = self._start("harness", self.command, self.cwd, env, log)
        if isinstance(process, str):
            self._runs[key] = _Running(_Failed(), log, directory, launch, stop_reason=process)
            return
        self._runs[key] = _Running(process, log, directory, launch)

    def _attempt_env(self, launch: Launch, directory: Path) -> dict[str, str]:
        """The contract both the harness and the verifier get (task, attribution, workspace)."""
        env: dict[str, str] = {}
        env.update(
            HARNESSRL_RUN=launch.run,
            HARNESSRL_ROLLOUT_ID=launch.rollout_id,
            HARNESSRL_ATTEMPT=str(launch.attempt),
            HARNESSRL_TASK_ID=launch.task_id,
            HARNESSRL_TASK_FILE=str(directory / "task.json"),
            HARNESSRL_POLICY_VERSION=str(launch.policy_version),
        )
        task = json.dumps(launch.task)
        if task_fits_in_env(task):  # a larger one is in the file alone (E2BIG)
            env["HARNESSRL_TASK"] = task
        if self.verifier is not None:
            env["HARNESSRL_WORKSPACE"] = str(directory)
        return env

    @staticmethod
    def _start(what: str, command: list[str], cwd: Path | None, env: dict[str, str],
               log: IO[bytes]) -> subprocess.Popen[bytes] | str:
        """The process, or why it could not start (reported as an exit, so the attempt fails with it)."""
        try:
            return subprocess.Popen(
                command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=die_with_parent(),  # noqa: PLW1509 - safe, see orphans.py
            )
        except OSError as exc:  # bad command
            log.write(f"cannot start {command[0]!r}: {exc}\n".encode())
            log.flush()
            return f"cannot start {what}: {exc}"

    def _advance(self, run: _Running) -> None:
        """Start the verifier of an attempt whose harness has just exited 0."""
        if self.verifier is None or run.verifying or run.stop_reason or run.process.poll() != 0:
            return
        run.verifying = True
        extra = self.verifier_env_for(run.launch) if self.verifier_env_for else {}
        env = {**os.environ, **self._attempt_env(run.launch, run.directory), **extra}
        process = self._start("verifier", self.verifier, run.directory, env, run.log)
        if isinstance(process, str):
            run.process, run.stop_reason = _Failed(), process
        else:
            run.process = process

    def alive(self) -> set[tuple[str, int]]:
        for run in self._runs.values():
            self._advance(run)
        return {key for key, run in self._runs.items() if run.process.poll() is None}

    def exits(self) -> list[HarnessExit]:
        ended = []
        for (rollout_id, attempt), run in self._runs.items():
            self._advance(run)
            code = run.process.poll()
            if code is None:
                continue
            detail = run.stop_reason or _signal_name(code)
            if run.verifying and not run.stop_reason and code != 0:
                detail = f"verifier {detail or f'exited {code}'}"
            ended.append(HarnessExit(rollout_id, attempt, None if isinstance(run.process, _Failed) else code, detail))
        return ended

    def stop(self, rollout_id: str, attempt: int, reason: str) -> None:
        run = self._runs.get((rollout_id, attempt))
        if run is None or run.process.poll() is not None:
            return
        run.stop_reason = reason
        _kill_group(run.process, signal.SIGTERM)
        try:
            run.process.wait(timeout=self.kill_grace_s)
        except subprocess.TimeoutExpired:
            _kill_group(run.process, signal.SIGKILL)
            run.process.wait()

    def release(self, rollout_id: str, attempt: int) -> None:
        run = self._runs.pop((rollout_id, attempt), None)
        if run is not None:
            run.log.close()

    def log_path(self, rollout_id: str, attempt: int) -> Path:
        return self.workdir / "rollouts" / f"{rollout_id}-a{attempt}" / "harness.log"

    def shutdown(self) -> None:
        for (rollout_id, attempt) in list(self._runs):
            self.stop(rollout_id, attempt, "the runner is stopping")
            self.release(rollout_id, attempt)


class _Failed:
    """Stands in for a process that could not be started, so it is reported through ``exits``."""

    pid = -1

    def poll(self) -> int:
        return -1

    def wait(self, timeout: float | None = None) -> int:
        return -1


def _kill_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def _signal_name(code: int) -> str | None:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return None
