"""Training rows from one rollout attempt's stored LLM calls: prefix merge, loss masks, rollout log-probs.

A multi-turn agent sends each call with the whole conversation so far, so call ``n + 1``'s prompt usually is
call ``n``'s prompt + completion + some new tokens (tool output, environment text, template tokens). Training
on one row per call would cost the sum of all prompts; merging them costs the final length once. Tokens are
never re-tokenized: the row is made of the exact IDs the server saw and produced, the generated ones get
``loss_mask`` 1 and their rollout log-probs, everything else mask 0.

How each call is placed (calls are taken in ``seq`` order):

* **Delta calls** (``parent_call_id`` set, as the trace store writes them) extend their parent's tokens by
  ``prompt_suffix``; the parent's tokens are read in place from the row it sits in, so when that row is the
  current one and the parent sits at the end of its kept content this is a plain append, no prompt is
  compared. **Parent-less calls** (the first call, a prompt that extends no earlier call, or input from
  :func:`calls_from_records`) are compared against the rows in full.
* Row-equivalence invariant: every decision below is a function of the calls' full prompts, never of which
  parent a delta names. A store may delta-encode a call against any earlier call whose prompt + completion
  begins its prompt (it takes the longest it has stored), so rows from deltas equal rows from full records.
  The parent only makes the comparisons cheap: what a prompt shares with its parent's row is known, and what
  two rows share is compared once per pair and remembered (``_same_prefix``).
* A kept call whose prompt starts with the current row's *kept content* (everything up to the end of the last
  kept completion) extends the row. Otherwise the row is closed and a new one starts with the call's full
  prompt; the split is counted by where the prompt leaves the row, relative to the previous kept call whose
  prompt ends at ``pk``: inside or after the previous completion (first difference at or past ``pk``) is
  ``template_drift`` (the harness re-rendered the model's own output); otherwise a prompt that starts with
  no kept call's prompt is ``new_conversation`` (another conversation in the attempt, e.g. a sub-agent's
  first call, or an edit inside the first prompt); else a prompt shorter than the row's kept content (the
  conversation shrank instead of growing) is ``truncation`` (context dropped), and any other is
  ``history_edited``.
* Interleaved conversations (an agent and its sub-agent in one attempt): a call whose prompt does not extend
  the current row continues the row (of the ``ROW_SEARCH`` latest) whose kept content is the longest prefix
  of it, or whose last call it repeats; so each conversation merges into its own row, and only a call that
  continues none starts a new one.
* Retries: a kept call whose full prompt equals the previous kept call's prompt is a duplicate. The later one
  is kept by default ("the last OK one"); if the next kept call extends an earlier duplicate instead, that
  one is swapped back in. Exactly one call of such a run is kept; the others count as ``duplicate``, unless
  a later kept call that starts a new row continues one of them (its prompt begins with that duplicate's
  prompt + completion, the latest such first): then the "duplicate" was a conversation of its own, e.g. two
  sub-agents a harness started side by side with the same task (Codex's ``spawn_agent``: their first prompts
  are equal), and the new row begins with it, kept and trained, instead of holding its completion as
  context with mask 0. The row's split reason and position stay those of the call that started it.
* Errored, aborted and empty calls (and calls over the length limits) are dropped and counted, but their
  tokens are still *placed* so that a later call whose parent is a dropped call can be resolved: a dropped
  call that extends the row is appended past its kept content (and trimmed off the emitted row unless a kept
  call builds on it, in which case its tokens are context with mask 0); one whose prompt (+ completion) is a
  prefix of the row points into it; anything else is copied aside (rare: an errored call with an edited
  history). A parent whose tokens in a row were overwritten since (a dropped call's tail, a completion
  cut at ``max_row_tokens``) is rebuilt from its own tokens and its parent's. A call whose parent is not among
  the given calls cannot be reconstructed and is dropped as ``missing_parent`` (so are its descendants).
* Length limits, per call: a prompt longer than ``max_prompt_tokens`` drops the call (``prompt_too_long``);
  so does a prompt that leaves no room below ``max_row_tokens`` (``row_too_long``); a completion running past
  ``max_row_tokens`` is cut there (counted in ``truncated_completions``/``truncated_tokens``). A row always
  starts at the conversation's first token (a causal model's log-probs depend on the whole prefix), so a row
  can never be shorter than its last call's prompt: splitting rows does not help length, dropping does.

Cost: every input token is converted once, when it is appended to a preallocated int64 buffer (amortized
doubling), and rows are cut from buffers with one copy; so time is linear in the tokens of the rows produced
plus the tokens of parent-less prompts that must be compared, and a delta-form trajectory of ``n`` turns is
never re-scanned per turn. Token sequences may be lists (the ``StoredCall`` contract) or integer numpy arrays
(e.g. ``np.frombuffer`` over the store's packed bytes), which append at memory speed.
"""

from __future__ import annotations

import enum
import itertools
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from harnessrl.store.records import CallRecord, CallStatus, StoredCall

RowMode = Literal["merge", "transition"]
ROW_SEARCH = 8  # rows a parent-less call may continue besides the current one (interleaved conversations)
log = logging.getLogger(__name__)


class SplitReason(str, enum.Enum):
    """Why a kept call could not extend the current row and started a new one."""

    HISTORY_EDITED = "history_edited"
    NEW_CONVERSATION = "new_conversation"
    TEMPLATE_DRIFT = "template_drift"
    TRUNCATION = "truncation"


class DropReason(str, enum.Enum):
    """Why a call contributes no generated tokens."""

    DUPLICATE = "duplicate"
    ERROR = "error"
    ABORTED = "aborted"
    EMPTY = "empty"
    MALFORMED = "malformed"  # log-probs do not line up with the completion tokens
    PROMPT_TOO_LONG = "prompt_too_long"
    ROW_TOO_LONG = "row_too_long"
    MISSING_PARENT = "missing_parent"
    DUPLICATE_SEQ = "duplicate_seq"  # every call of an attempt where two calls share a seq (order unknown)


@dataclass(frozen=True, eq=False)
class Row:
    """One training sequence. Arrays are read-only; transition rows of one rollout may share ``input_ids``.

    ``completion_spans[i]`` is ``[start, end)`` of the kept completion of ``call_ids[i]``; its prompt is
    ``input_ids[:start]``. ``loss_mask`` is 1 exactly on those spans; ``rollout_logprobs`` holds the serving
    engine's log-probs there and 0 elsewhere.
    """

    rollout_id: str
    attempt: int
    input_ids: np.ndarray  # int64 [n]
    loss_mask: np.ndarray  # int8 [n]
    rollout_logprobs: np.ndarray  # float32 [n]
    call_ids: tuple[str, ...]
    completion_spans: tuple[tuple[int, int], ...]
    policy_versions: tuple[int, ...]  # one per call, the weights that produced its completion
    # Why this row could not continue an earlier one (a ``SplitReason`` value, counted in ``RowStats.splits``)
    # and the first position where its prompt leaves the row it split from (the tokens before it are that row's
    # too); None for the attempt's first row. In transition mode only the first call of a merged row carries it.
    split_reason: str | None = None
    split_at: int | None = None

    @property
    def min_policy_version(self) -> int:
        """The oldest weights behind any generated token: what staleness is measured from."""
        return min(self.policy_versions)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_generated(self) -> int:
        return sum(end - start for start, end in self.completion_spans)


@dataclass
class RowStats:
    """Counts for metrics; ``add`` sums them over rollouts."""

    calls: int = 0
    kept_calls: int = 0
    rows: int = 0
    merged_calls: int = 0  # kept calls that joined an existing row instead of starting one
    row_tokens: int = 0
    generated_tokens: int = 0
    truncated_completions: int = 0
    truncated_tokens: int = 0
    splits: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)

    def add(self, other: RowStats) -> None:
        for name in ("calls", "kept_calls", "rows", "merged_calls", "row_tokens", "generated_tokens",
                     "truncated_completions", "truncated_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.splits.update(other.splits)
        self.dropped.update(other.dropped)

    def as_metrics(self) -> dict[str, float]:
        """Flat names for the step record and Prometheus; every reason is present, zeros included."""
        out: dict[str, float] = {
            "calls": self.calls,
            "kept_calls": self.kept_calls,
            "rows": self.rows,
            "merged_calls": self.merged_calls,
            "row_tokens": self.row_tokens,
            "generated_tokens": self.generated_tokens,
            "truncated_completions": self.truncated_completions,
            "truncated_tokens": self.truncated_tokens,
        }
        for split in SplitReason:
            out[f"split_{split.value}"] = self.splits.get(split.value, 0)
        for drop in DropReason:
            out[f"dropped_{drop.value}"] = self.dropped.get(drop.value, 0)
        return out


@dataclass
class RowsResult:
    rows: list[Row]
    stats: RowStats


def calls_from_records(records: Sequence[CallRecord]) -> list[StoredCall]:
    """Full records as parent-less StoredCalls, so full-form input goes through the one row builder.

    Token lists are shared, not copied: the builder never mutates its input.
    """
    return [
        StoredCall(
            call_id=r.call_id,
            rollout_id=r.rollout_id,
            attempt=r.attempt,
            seq=r.seq,
            parent_call_id=None,
            prompt_suffix=r.prompt_token_ids,
            completion_token_ids=r.completion_token_ids,
            logprobs=r.logprobs,
            policy_version=r.policy_version,
            status=r.status,
            finish_reason=r.finish_reason,
        )
        for r in records
    ]


def merge_calls_into_rows(
    calls: Sequence[StoredCall],
    *,
    mode: RowMode = "merge",
    max_prompt_tokens: int | None = None,
    max_row_tokens: int | None = None,
) -> RowsResult:
    """Turn one rollout attempt's calls into training rows (see the module docstring for the rules).

    ``merge`` gives one row per unbroken chain of kept calls; ``transition`` one row per kept call (its
    full prompt + its completion, earlier completions in the prompt masked 0). Both modes keep and drop the
    same calls, and ``stats.splits`` counts in both where a merge had to start a new row.
    """
    if mode not in ("merge", "transition"):
        raise ValueError(f"mode: {mode!r} is not a row mode; use 'merge' or 'transition'")
    for name, limit in (("max_prompt_tokens", max_prompt_tokens), ("max_row_tokens", max_row_tokens)):
        if limit is not None and limit < 1:
            raise ValueError(f"{name}: {limit} is below 1; pass a positive token count or None for no limit")
    builder = _RowBuilder(max_prompt_tokens, max_row_tokens)
    ordered = _checked_order(calls)
    if ordered is None:  # two calls at one seq: the trajectory's order is unknown, so it trains nothing
        builder.stats.calls = len(calls)
        builder.stats.dropped[DropReason.DUPLICATE_SEQ.value] += len(calls)
        return RowsResult([], builder.stats)
    for call in ordered:
        builder.add(call)
    if not ordered:
        return RowsResult([], builder.stats)
    first = ordered[0]
    return builder.finish(first.rollout_id, first.attempt, mode)


def _checked_order(calls: Sequence[StoredCall]) -> list[StoredCall] | None:
    """One rollout attempt, unique call ids, in seq order (the store already returns them so).

    None when two calls share a seq (a store from before the unique constraint, or input built by hand):
    which came first is unknown, so no row can be trusted. The attempt is skipped with a warning naming it
    and its calls counted as ``duplicate_seq``, instead of an error that would stop the learner on that
    group at every step."""
    if not calls:
        return []
    first = calls[0]
    seen: set[str] = set()
    in_order = True
    previous_seq = None
    for index, call in enumerate(calls):
        if call.rollout_id != first.rollout_id or call.attempt != first.attempt:
            raise ValueError(
                f"calls[{index}]: belongs to rollout {call.rollout_id!r} attempt {call.attempt}, calls[0] to "
                f"{first.rollout_id!r} attempt {first.attempt}; pass one rollout attempt at a time"
            )
        if call.call_id in seen:
            raise ValueError(f"calls[{index}].call_id: {call.call_id!r} appears twice; pass each call once")
        seen.add(call.call_id)
        if previous_seq is not None and call.seq <= previous_seq:
            in_order = False
        previous_seq = call.seq
    if in_order:
        return list(calls)
    ordered = sorted(calls, key=lambda c: c.seq)
    for a, b in itertools.pairwise(ordered):
        if a.seq == b.seq:
            log.warning(
                "rollout %s attempt %d: calls %r and %r share seq %d, so the order of its calls is unknown; "
                "skipped (no rows; counted as dropped_duplicate_seq). `harnessrl db upgrade` removes such "
                "duplicates from a store", first.rollout_id, first.attempt, a.call_id, b.call_id, a.seq,
            )  # fmt: skip
            return None
    return ordered


TokenIds = Sequence[int] | np.ndarray  # the store's lists, or int arrays straight from its bytes


def _ids(tokens: TokenIds) -> np.ndarray:
    """An int64 view or copy, for comparisons and concatenations (never mutated)."""
    return np.asarray(tokens, dtype=np.int64)


class _Buffer:
    """A growing token sequence in an int64 array; it is emitted as a row once it holds a kept call.

    Tokens are converted from the input exactly once, when appended. Only content past the last kept
    completion is ever cut (``truncate``), except when a duplicate replaces the last kept call; every cut is
    logged so placements that pointed past it know they are stale.
    """

    __slots__ = ("alternatives", "data", "index", "kept", "kept_end", "length", "split", "truncations")

    def __init__(self, tokens: TokenIds, index: int) -> None:
        self.index = index  # position among the builder's rows (key of remembered prefix comparisons)
        n = len(tokens)
        self.data = np.empty(max(2 * n, 4096), dtype=np.int64)
        self.data[:n] = tokens
        self.length = n
        self.kept: list[_Placed] = []
        self.kept_end = 0
        self.truncations: list[int] = []
        self.alternatives: list[_Placed] = []  # duplicates of the last kept call, swapped out
        self.split: tuple[str, int] | None = None  # (reason, position) when the row began at a split

    def append(self, tokens: TokenIds) -> None:
        k = len(tokens)
        if not k:
            return
        need = self.length + k
        if need > self.data.shape[0]:
            grown = np.empty(max(need, 2 * self.data.shape[0]), dtype=np.int64)
            grown[: self.length] = self.data[: self.length]
            self.data = grown
        self.data[self.length : need] = tokens
        self.length = need

    def truncate(self, length: int) -> None:
        if self.length > length:
            self.length = length
            self.truncations.append(length)


class _Placed:
    """Where one call's full prompt + completion can be read back: ``buffer.data[:end] + extra``.

    For a kept call, its completion starts at ``prompt_end`` and its first ``keep`` tokens are trained on.
    """

    __slots__ = ("buffer", "call", "end", "extra", "keep", "n_trunc", "parent", "prompt_end")

    def __init__(
        self, call: StoredCall, buffer: _Buffer | None, end: int, extra: np.ndarray | None = None
    ) -> None:
        self.call = call
        self.buffer = buffer
        self.end = end
        self.n_trunc = len(buffer.truncations) if buffer is not None else 0
        self.extra = extra
        self.prompt_end = 0
        self.keep = 0
        self.parent: _Placed | None = None  # the placement of the call's delta parent (None: parent-less)

    def valid(self) -> bool:
        buffer = self.buffer
        if buffer is None:
            return True
        truncations = buffer.truncations
        if len(truncations) == self.n_trunc:
            return True
        return min(truncations[self.n_trunc:]) >= self.end

    def materialize(self) -> np.ndarray:
        """The full prompt + completion as a new array (O(length); only on rare paths).

        A placement whose row was cut below its end (a dropped call's tail overwritten by a later call, a
        completion past ``max_row_tokens``) is rebuilt from its own tokens and its parent's, so a later call
        that a store delta-encoded against it still resolves."""
        rebuilt: list[StoredCall] = []
        node: _Placed | None = self
        while node is not None and not node.valid():
            rebuilt.append(node.call)
            node = node.parent
        parts: list[np.ndarray] = []
        if node is not None:
            if node.buffer is not None:
                parts.append(node.buffer.data[: node.end])
            if node.extra is not None:
                parts.append(node.extra)
        for call in reversed(rebuilt):
            parts += (_ids(call.prompt_suffix), _ids(call.completion_token_ids))
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


class _RowBuilder:
    def __init__(self, max_prompt_tokens: int | None, max_row_tokens: int | None) -> None:
        self.max_prompt = max_prompt_tokens
        self.max_row = max_row_tokens
        self.stats = RowStats()
        self.placed: dict[str, _Placed] = {}
        self.cur: _Buffer | None = None
        self.rows: list[_Buffer] = []
        self.retired: list[_Placed] = []  # duplicates dropped as retries, a later row may begin with one
        # (row index, row index) -> (leading tokens known equal, differ right after?, cuts seen of each row)
        self._prefixes: dict[tuple[int, int], tuple[int, bool, int, int]] = {}

    # -- one call ---------------------------------------------------------------------------------------------

    def add(self, call: StoredCall) -> None:
        self.stats.calls += 1
        parent = None
        if call.parent_call_id is not None:
            parent = self.placed.get(call.parent_call_id)
            if parent is None:
                self.stats.dropped[DropReason.MISSING_PARENT.value] += 1
                return
        self._add(call, _view(parent, call.prompt_suffix))
        self.placed[call.call_id].parent = parent

    def _add(self, call: StoredCall, view: _View) -> None:
        reason = _status_drop_reason(call)
        # The row is chosen from the prompt's tokens alone (never from which parent the store delta-encoded
        # the call against), then the prompt is expressed as cur.data[:e] + suffix (e == 0: suffix is all).
        cur = self.cur
        matched = -1
        if cur is not None:
            cur, matched = self._row_for(view, cur)
            self.cur = cur
        e, suffix = _relative(view, cur, matched)
        length = e + len(suffix)
        if reason is None:
            reason = self._length_drop_reason(length)
        keepable = reason is None
        if not keepable:
            self.stats.dropped[reason.value] += 1

        if cur is None:
            if keepable:
                buffer = self._new_row(suffix)
                self.cur = buffer
                self._append_kept(buffer, call, length)
            else:
                self._place_aside(call, _ids(suffix))
            return

        kept_end = cur.kept_end
        extends, diverge_at = _relation(cur.data, e, suffix, kept_end)
        if keepable and not extends:
            last = cur.kept[-1]
            if diverge_at == length == last.prompt_end:
                self._replace_duplicate(cur, call, length)
                return
            if cur.alternatives and diverge_at >= last.prompt_end:
                alternative = _alternative_extended_by(cur, last.prompt_end, e, suffix)
                if alternative is not None:
                    if e > last.prompt_end:  # the swap rewrites data past prompt_end: keep the prompt whole
                        suffix = np.concatenate((cur.data[last.prompt_end : e], _ids(suffix)))
                        e = last.prompt_end
                    self._swap_in(cur, alternative)
                    kept_end = cur.kept_end
                    extends, diverge_at = _relation(cur.data, e, suffix, kept_end)

        if extends:
            base = max(e, kept_end)
            cur.truncate(base)
            cur.append(suffix if base == e else suffix[base - e :])
            if keepable:
                self._append_kept(cur, call, length)
            else:
                cur.append(call.completion_token_ids)
                self.placed[call.call_id] = _Placed(call, cur, cur.length)
            return

        prompt = np.concatenate((cur.data[:e], _ids(suffix)))
        if keepable:
            last = cur.kept[-1]
            split = _split_reason(diverge_at, length, last.prompt_end, kept_end)
            if split is not SplitReason.TEMPLATE_DRIFT and not self._begins_with_a_kept_prompt(
                _View(cur, e, suffix, length)
            ):
                split = SplitReason.NEW_CONVERSATION
            self.stats.splits[split.value] += 1
            revived = self._revived_duplicate(prompt)
            start = length if revived is None else revived.prompt_end
            buffer = self._new_row(prompt[:start])
            buffer.split = (split.value, diverge_at)
            if revived is not None:  # the row begins with the duplicate this call continues
                self._append_kept(buffer, revived.call, start)
                self.placed[revived.call.call_id].parent = revived.parent
                buffer.append(prompt[buffer.length :])
            self.cur = buffer
            self._append_kept(buffer, call, length)
            return

        completion = call.completion_token_ids
        end = length + len(completion)
        if diverge_at == length and end <= kept_end and np.array_equal(cur.data[length:end], _ids(completion)):
            self.placed[call.call_id] = _Placed(call, cur, end)  # prompt + completion are a prefix of the row
        else:
            self._place_aside(call, prompt)

    # -- helpers ------------------------------------------------------------------------------------------------

    def _row_for(self, view: _View, cur: _Buffer) -> tuple[_Buffer, int]:
        """The row a prompt continues, and how many of its tokens that row's content gives (-1: none).

        The current row if the prompt extends it (or repeats its last call), else the row among the
        ``ROW_SEARCH`` latest whose kept content is the longest prefix of the prompt or whose last call it
        repeats (interleaved conversations: an agent and its sub-agent), else the current one (the prompt
        starts a new row, a split counted against it). A function of the prompt's tokens only, so full
        records and any delta encoding of them choose the same row."""
        matched = self._continues(cur, view)
        if matched >= 0:
            return cur, matched
        best, best_matched, best_end = cur, -1, -1
        for buffer in self.rows[-ROW_SEARCH:]:
            if buffer is not cur and buffer.kept_end > best_end:
                matched = self._continues(buffer, view)
                if matched >= 0:
                    best, best_matched, best_end = buffer, matched, buffer.kept_end
        return best, best_matched

    def _continues(self, buffer: _Buffer, view: _View) -> int:
        """``buffer.kept_end`` if the prompt extends the row's kept content, its last kept call's prompt length
        if the prompt repeats that prompt, else -1."""
        n = buffer.kept_end
        if view.length >= n:
            return n if self._matches(buffer, n, view) else -1
        last = buffer.kept[-1].prompt_end
        return last if view.length == last and self._matches(buffer, last, view) else -1

    def _matches(self, buffer: _Buffer, n: int, view: _View) -> bool:
        """Whether the prompt (at least ``n`` tokens) starts with ``buffer.data[:n]``.

        The part the prompt takes from its base row is compared through ``_same_prefix`` (remembered per
        pair of rows), so a delta call costs its new tokens, not its length; a parent-less prompt is
        compared in full."""
        e = view.e
        m = min(n, e)
        if m and view.base is not buffer and not self._same_prefix(buffer, view.base, m):
            return False
        if n <= e:
            return True
        return bool(np.array_equal(buffer.data[e:n], _ids(view.tail[: n - e])))

    def _same_prefix(self, a: _Buffer, b: _Buffer, m: int) -> bool:
        """Whether two rows' first ``m`` tokens are equal (both hold at least ``m``).

        Per pair the builder remembers how many leading tokens are known equal and whether they differ right
        after; a row only changes past a cut it logs (``truncations``), so each token pair is compared about
        once and interleaved conversations are told apart in constant time per call."""
        if a.index > b.index:
            a, b = b, a
        key = (a.index, b.index)
        known = self._prefixes.get(key)
        equal, differs = 0, False
        if known is not None:
            equal, differs, cuts_a, cuts_b = known
            cut = min(_cut_since(a, cuts_a), _cut_since(b, cuts_b))
            if cut <= equal:
                equal, differs = cut, False
        if m <= equal:
            result = True
        elif differs:
            result = False
        else:
            differ = np.flatnonzero(a.data[equal:m] != b.data[equal:m])
            result = not differ.size
            equal, differs = (m, False) if result else (equal + int(differ[0]), True)
        self._prefixes[key] = (equal, differs, len(a.truncations), len(b.truncations))
        return result

    def _begins_with_a_kept_prompt(self, view: _View) -> bool:
        """Whether the prompt starts with the prompt of any call kept so far (a row's first kept prompt is the
        shortest of its row, the others extend it); only asked at a split."""
        for buffer in self.rows:
            n = buffer.kept[0].prompt_end
            if view.length >= n and self._matches(buffer, n, view):
                return True
        return False

    def _revived_duplicate(self, prompt: np.ndarray) -> _Placed | None:
        """The latest duplicate dropped as a retry whose prompt + completion ``prompt`` begins with: it is taken
        back from the retired ones and its ``duplicate`` drop uncounted (None: none). Only asked at a split."""
        for placed in sorted(self.retired, key=lambda p: p.call.seq, reverse=True):
            full = placed.materialize()
            if len(full) <= len(prompt) and np.array_equal(prompt[: len(full)], full):
                self.retired.remove(placed)
                for buffer in self.rows:
                    if placed in buffer.alternatives:
                        buffer.alternatives.remove(placed)
                self.stats.dropped[DropReason.DUPLICATE.value] -= 1
                if not self.stats.dropped[DropReason.DUPLICATE.value]:
                    del self.stats.dropped[DropReason.DUPLICATE.value]
                return placed
        return None

    def _new_row(self, prompt: TokenIds) -> _Buffer:
        buffer = _Buffer(prompt, len(self.rows))
        self.rows.append(buffer)
        return buffer

    def _length_drop_reason(self, prompt_length: int) -> DropReason | None:
        if self.max_prompt is not None and prompt_length > self.max_prompt:
            return DropReason.PROMPT_TOO_LONG
        if self.max_row is not None and prompt_length >= self.max_row:
            return DropReason.ROW_TOO_LONG
        return None

    def _keep_count(self, prompt_length: int, completion_length: int) -> int:
        if self.max_row is None:
            return completion_length
        return min(completion_length, self.max_row - prompt_length)

    def _append_kept(
        self, buffer: _Buffer, call: StoredCall, prompt_length: int, alternatives: list[_Placed] | None = None
    ) -> None:
        """Append a kept call's completion at the end of ``buffer``, whose tokens are exactly its prompt."""
        completion = call.completion_token_ids
        buffer.append(completion)
        placed = _Placed(call, buffer, buffer.length)
        placed.prompt_end = prompt_length
        placed.keep = self._keep_count(prompt_length, len(completion))
        buffer.kept.append(placed)
        buffer.kept_end = prompt_length + placed.keep
        buffer.alternatives = alternatives if alternatives is not None else []
        self.placed[call.call_id] = placed

    def _place_aside(self, call: StoredCall, prompt: np.ndarray) -> None:
        """A dropped call that fits no row: keep a private copy so a child of it can still be resolved."""
        full = np.concatenate((prompt, _ids(call.completion_token_ids)))
        self.placed[call.call_id] = _Placed(call, None, 0, full)

    def _replace_duplicate(self, buffer: _Buffer, call: StoredCall, prompt_length: int) -> None:
        """``call`` retries the last kept call (same prompt): keep ``call``, hold the other as an alternative."""
        self.stats.dropped[DropReason.DUPLICATE.value] += 1
        retired = _retire_last_kept(buffer)
        self.retired.append(retired)
        self._append_kept(buffer, call, prompt_length, buffer.alternatives + [retired])

    def _swap_in(self, buffer: _Buffer, alternative: _Placed) -> None:
        """The next call extends an earlier duplicate: make that one the kept call again."""
        retired = _retire_last_kept(buffer)
        self.retired = [r for r in self.retired if r is not alternative] + [retired]
        pending = [a for a in buffer.alternatives if a is not alternative] + [retired]
        completion = alternative.call.completion_token_ids
        buffer.append(completion)
        alternative.end = buffer.length
        alternative.n_trunc = len(buffer.truncations)
        alternative.extra = None
        alternative.keep = self._keep_count(alternative.prompt_end, len(completion))
        buffer.kept.append(alternative)
        buffer.kept_end = alternative.prompt_end + alternative.keep
        buffer.alternatives = pending

    # -- output -------------------------------------------------------------------------------------------------

    def finish(self, rollout_id: str, attempt: int, mode: RowMode) -> RowsResult:
        stats = self.stats
        rows: list[Row] = []
        transitions: list[tuple[int, Row]] = []
        for buffer in self.rows:
            input_ids = buffer.data[: buffer.kept_end].copy()
            input_ids.setflags(write=False)
            if mode == "merge":
                rows.append(_make_row(rollout_id, attempt, input_ids, buffer.kept, buffer.split))
            else:
                for placed in buffer.kept:
                    view = input_ids[: placed.prompt_end + placed.keep]
                    split = buffer.split if placed is buffer.kept[0] else None
                    transitions.append((placed.call.seq, _make_row(rollout_id, attempt, view, [placed], split)))
            stats.kept_calls += len(buffer.kept)
        if mode == "transition":
            transitions.sort(key=lambda item: item[0])
            rows = [row for _, row in transitions]
        stats.rows = len(rows)
        stats.merged_calls = stats.kept_calls - len(rows)
        for row in rows:
            stats.row_tokens += row.num_tokens
            stats.generated_tokens += row.num_generated
        for buffer in self.rows:
            for placed in buffer.kept:
                cut = len(placed.call.completion_token_ids) - placed.keep
                if cut:
                    stats.truncated_completions += 1
                    stats.truncated_tokens += cut
        return RowsResult(rows, stats)


def _retire_last_kept(buffer: _Buffer) -> _Placed:
    """Take the last kept call out of ``buffer``; it stays resolvable as ``prompt + extra`` (its completion)."""
    last = buffer.kept.pop()
    buffer.truncate(last.prompt_end)
    last.end = last.prompt_end
    last.n_trunc = len(buffer.truncations)
    last.extra = _ids(last.call.completion_token_ids)
    buffer.kept_end = buffer.kept[-1].prompt_end + buffer.kept[-1].keep if buffer.kept else 0
    return last


def _alternative_extended_by(buffer: _Buffer, prompt_end: int, e: int, suffix: TokenIds) -> _Placed | None:
    """The latest swapped-out duplicate whose prompt + completion the new prompt starts with."""
    for alternative in sorted(buffer.alternatives, key=lambda a: a.call.seq, reverse=True):
        completion = alternative.extra
        stop = prompt_end + len(completion)
        if e + len(suffix) >= stop and np.array_equal(_prompt_slice(buffer.data, e, suffix, prompt_end, stop),
                                                      completion):
            return alternative
    return None


def _make_row(rollout_id: str, attempt: int, input_ids: np.ndarray, kept: list[_Placed],
              split: tuple[str, int] | None) -> Row:
    n = input_ids.shape[0]
    loss_mask = np.zeros(n, dtype=np.int8)
    logprobs = np.zeros(n, dtype=np.float32)
    spans = []
    for placed in kept:
        start = placed.prompt_end
        stop = start + placed.keep
        loss_mask[start:stop] = 1
        source = placed.call.logprobs
        logprobs[start:stop] = source if placed.keep == len(source) else source[: placed.keep]
        spans.append((start, stop))
    loss_mask.setflags(write=False)
    logprobs.setflags(write=False)
    return Row(
        rollout_id=rollout_id,
        attempt=attempt,
        input_ids=input_ids,
        loss_mask=loss_mask,
        rollout_logprobs=logprobs,
        call_ids=tuple(p.call.call_id for p in kept),
        completion_spans=tuple(spans),
        policy_versions=tuple(p.call.policy_version for p in kept),
        split_reason=split[0] if split else None,
        split_at=split[1] if split else None,
    )


def _status_drop_reason(call: StoredCall) -> DropReason | None:
    status = call.status
    if status == CallStatus.ERROR:
        return DropReason.ERROR
    if status == CallStatus.ABORTED:
        return DropReason.ABORTED
    if not len(call.completion_token_ids):
        return DropReason.EMPTY
    if len(call.logprobs) != len(call.completion_token_ids):
        return DropReason.MALFORMED
    return None


@dataclass(frozen=True, slots=True)
class _View:
    """A prompt as ``base.data[:e] + tail`` (``base`` None: ``tail`` is the whole prompt), ``length`` tokens."""

    base: _Buffer | None
    e: int
    tail: TokenIds
    length: int


def _view(parent: _Placed | None, suffix: TokenIds) -> _View:
    """A call's prompt: its parent's prompt + completion (read in place from the parent's row) + suffix."""
    if parent is None:
        return _View(None, 0, suffix, len(suffix))
    if parent.buffer is not None and parent.valid():
        tail = suffix if parent.extra is None else np.concatenate((parent.extra, _ids(suffix)))
        return _View(parent.buffer, parent.end, tail, parent.end + len(tail))
    whole = np.concatenate((parent.materialize(), _ids(suffix)))
    return _View(None, 0, whole, len(whole))


def _relative(view: _View, cur: _Buffer | None, matched: int) -> tuple[int, TokenIds]:
    """The prompt as ``(e, suffix)`` with ``cur.data[:e] + suffix`` equal to it; ``matched``: how many of its
    first tokens ``cur.data`` is known to hold (-1: unknown)."""
    base, e, tail = view.base, view.e, view.tail
    if base is None:
        return 0, tail
    if base is cur:
        return e, tail
    if matched >= e:
        return matched, tail[matched - e :]
    if matched >= 0:
        return matched, np.concatenate((base.data[matched:e], _ids(tail)))
    return 0, np.concatenate((base.data[:e], _ids(tail)))


def _cut_since(buffer: _Buffer, seen: int) -> int:
    """The shortest length ``buffer`` was cut to after its first ``seen`` cuts (no cut: a huge number)."""
    return min(buffer.truncations[seen:], default=1 << 62)


def _relation(data: np.ndarray, e: int, suffix: TokenIds, kept_end: int) -> tuple[bool, int]:
    """Does ``data[:e] + suffix`` start with ``data[:kept_end]``? Else where do they first differ.

    ``data[:e]`` is already the prompt's own prefix, so only ``suffix`` against ``data[e:kept_end]`` is
    compared, and nothing at all in the delta case (``e >= kept_end``).
    """
    if e >= kept_end:
        return True, kept_end
    span = kept_end - e
    n = min(span, len(suffix))
    differ = np.flatnonzero(_ids(suffix[:n]) != data[e : e + n])
    if differ.size:
        return False, e + int(differ[0])
    return (True, kept_end) if n == span else (False, e + n)


def _split_reason(diverge_at: int, prompt_length: int, previous_prompt_end: int, kept_end: int) -> SplitReason:
    if diverge_at >= previous_prompt_end:
        return SplitReason.TEMPLATE_DRIFT
    if prompt_length < kept_end:
        return SplitReason.TRUNCATION
    return SplitReason.HISTORY_EDITED


def _prompt_slice(data: np.ndarray, e: int, suffix: TokenIds, start: int, stop: int) -> np.ndarray:
    """``(data[:e] + suffix)[start:stop]`` without building the whole prompt."""
    head = data[start : min(stop, e)] if start < e else data[:0]
    if stop <= e:
        return head
    return np.concatenate((head, _ids(suffix[max(start - e, 0) : stop - e])))
