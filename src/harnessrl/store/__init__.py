"""The trace store: runs, tasks, rollouts and every captured LLM call, on SQLite or PostgreSQL.

Import the public names from here; the modules behind them (schema, codec, delta, states, migrate, ...) are
implementation detail.
"""

from harnessrl.store.call_rows import InvalidCall, PreparedCall, prepare_call
from harnessrl.store.delta import StoreCorruption
from harnessrl.store.engine import StoreError
from harnessrl.store.records import AttemptRecord, CallRecord, CallStatus, RolloutState, StoredCall
from harnessrl.store.statements import NotFound, RunOwnedElsewhere
from harnessrl.store.states import AttemptSettled, IllegalTransition, check_transition, is_legal
from harnessrl.store.trace_store import TraceStore

__all__ = [
    "AttemptRecord",
    "AttemptSettled",
    "CallRecord",
    "CallStatus",
    "IllegalTransition",
    "InvalidCall",
    "NotFound",
    "PreparedCall",
    "RolloutState",
    "RunOwnedElsewhere",
    "StoreCorruption",
    "StoreError",
    "StoredCall",
    "TraceStore",
    "check_transition",
    "is_legal",
    "prepare_call",
]
