"""Bringing a freshly started vLLM server to the run's committed version before it serves a call.

Run by the vLLM gate (``harnessrl vllm-gate --served-marker PATH``). It watches the server behind the gate:

- **down**: the server does not answer (starting, restarting after a crash, an OOM kill or a failed liveness
  probe). Calls and the learner's control requests get 503, which both retry.
- **restoring**: the server answers again. A weight label that is a version number means it already serves a
  version (only the gate restarted): nothing to do. Otherwise (a new server's label is ``default``) the gate
  loads the version that :mod:`harnessrl.served_marker` names, labels the server with it, and only then opens.
  With no marker yet, a full-weight run's server holds version 0 (the base model) and is labelled so; a LoRA
  run's server waits for the learner's first marker (version 0 is the learner's fresh adapter).
- **ready**: calls and control requests pass. The gate's ``/ready`` answers 200, so the pod turns Ready and
  joins the replicas that proxies and the learner's sync resolve.

No control request reaches a server before its restore is done, so the learner's sync and the restore never
interleave on one server (a load from one and a label from the other would mislabel its weights).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Literal

import aiohttp

from harnessrl.policy_serving import label_request, load_request
from harnessrl.served_marker import MarkerError, read_marker

log = logging.getLogger("harnessrl.vllm_gate")

State = Literal["down", "restoring", "ready"]


class ReplicaRestore:
    """The state of the server behind one gate and the loop that restores it (module docstring)."""

    def __init__(self, session: aiohttp.ClientSession, upstream: str, marker: Path, lora_name: str | None,
                 poll_s: float = 1.0) -> None:
        self.session = session
        self.upstream = upstream.rstrip("/")
        self.marker = marker
        self.lora_name = lora_name
        self.poll_s = poll_s
        self.state: State = "down"
        self.detail = "vLLM has not answered yet"
        self.restored: list[int] = []  # versions this gate loaded into new servers, for its log and tests

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    async def run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.poll_s)

    async def check(self) -> None:
        label = await self._label()
        if label is None:
            if self.state != "down":
                log.warning("vLLM at %s stopped answering: closed until it is back and restored", self.upstream)
            self.state, self.detail = "down", "vLLM does not answer"
            return
        if self.state == "ready":
            return
        if label.isdigit():  # a server that already serves a version (the gate restarted, not vLLM)
            self._open(f"serves version {label}")
            return
        self.state = "restoring"
        try:
            served = read_marker(self.marker)
        except MarkerError as exc:
            self.detail = str(exc)
            return
        try:
            if served is None:
                if self.lora_name is not None:
                    self.detail = (f"waiting for the learner's first version ({self.marker} does not exist yet): a "
                                   "LoRA policy's version 0 is the learner's fresh adapter")
                    return
                await self._post(*label_request(0))  # full weights: a new server holds the base model
                self._open("serves version 0, the base model")
                return
            await self._post(*load_request(served.checkpoint, self.lora_name))
            await self._post(*label_request(served.version))
        except (aiohttp.ClientError, TimeoutError, RestoreError) as exc:
            self.detail = f"loading version {served.version if served else 0} failed: {exc}"
            log.error("vLLM at %s: %s (retried)", self.upstream, self.detail)
            return
        self.restored.append(served.version)
        self._open(f"restored version {served.version} from {served.checkpoint}")

    def _open(self, detail: str) -> None:
        self.state, self.detail = "ready", detail
        log.info("vLLM at %s %s: open", self.upstream, detail)

    async def _label(self) -> str | None:
        try:
            async with self.session.get(f"{self.upstream}/weight_info",
                                        timeout=aiohttp.ClientTimeout(total=10)) as resp:
                if resp.status != 200:
                    return None
                return str((await resp.json()).get("weight_version"))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    async def _post(self, path: str, body: dict) -> None:
        async with self.session.post(f"{self.upstream}{path}", json=body) as resp:
            if resp.status >= 400:
                raise RestoreError(f"POST {path}: {resp.status} {(await resp.text())[:300]}")


class RestoreError(RuntimeError):
    """vLLM refused a request of the restore."""
