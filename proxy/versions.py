"""Where the proxy learns the policy version that the upstreams are serving.

Rule for a call in flight across a version change: it is recorded with the version that was current when
the proxy sent it to the upstream (the attempt that succeeded, if it was retried) -- the weights that
produced its first token. A learner that pauses the proxy, waits for the drain, reloads, sets the version and
resumes makes that exact; without a pause a call that straddles an in-place reload carries the older
version, which is the conservative label for off-policy corrections.

Today the version arrives by ``POST /admin/policy-version`` (``AdminPolicyVersion``). With hundreds of
sidecars the learner will publish it once, in the store; a source that polls it only has to implement
``current()``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class PolicyVersionSource(Protocol):
    def current(self) -> int: ...


class AdminPolicyVersion:
    """The version as last told by the admin route (starting from the configured one)."""

    settable = True

    def __init__(self, initial: int = 0) -> None:
        self._version = initial

    def current(self) -> int:
        return self._version

    def set(self, version: int) -> None:
        if version < 0:
            raise ValueError("policy version must be >= 0")
        self._version = version
