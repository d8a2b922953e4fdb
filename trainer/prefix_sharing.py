"""A group's common prefix computed once: rows that share their first tokens are packed into one sequence.

All rollouts of a task share their prompt (system prompt, tool schemas, the task, repository context), often
thousands of tokens, and a group has 8 or more of them. Computed row by row, every row runs that prefix through
the model again, forward and backward. Packed, the prefix appears once, followed by each row's own suffix::

    [ prefix (P tokens) | suffix of row 1 | suffix of row 2 | ... ]

with an attention mask under which a prefix token sees the prefix causally and a suffix token sees the whole
prefix and its own suffix causally (never another row's suffix), and position ids that restart at ``P`` for
every suffix. Each row then sees exactly the keys, values and positions it sees alone, so its log-probs are the
same function of the weights, and autograd sums the gradients of every row through the prefix's activations,
which exist once: the gradient is the sum over rows, as when every row is computed in full (within
floating-point rounding: the matrix shapes differ).

Why this mechanism and not the others the problem allows:

* **Reusing the prefix's KV cache** (one prefix forward with ``use_cache``, each suffix batched against the
  expanded cache) needs a cache written inside the forward pass. transformers turns ``use_cache`` off under
  gradient checkpointing, and a non-reentrant checkpoint would append to the cache again on recomputation; the
  cache also materialises ``rows x prefix`` keys and values per layer. It works neither with
  ``gradientCheckpointing`` nor without a copy per row.
* **Flex attention with a block mask** is the fastest on a GPU (it skips masked blocks and needs no dense mask),
  but needs ``torch.compile`` per shape and has no eager CPU kernel worth the name; the learner must run the same
  on both.
* **A shared-prefix mask** (this) is one ordinary forward of the model: DeepSpeed ZeRO sees a normal
  forward/backward at every stage (ZeRO-3 gathers parameters by module hooks exactly as for any batch), peft's
  LoRA layers are plain linear layers in it, gradient checkpointing recomputes it like any layer, and the
  transformers attention implementations ``sdpa`` and ``eager`` take a ready 4D mask as it is. Its price is the
  dense ``[T, T]`` mask per packed sequence (a bool byte per pair, the same order as the padding mask a padded
  batch of rows already builds). SDPA would compute every pair of the packed length under that mask (the
  masked ones too), so under ``sdpa`` the engine has it computed block by block, the prefix causally and each
  suffix against the prefix and itself (:func:`shared_prefix_attention`): the pairs the rows need.
  FlashAttention-2 takes no such mask, and sliding-window layers would need the window in it: models using
  either train row by row (:func:`supports_prefix_sharing`).

Which rows share: rows are sorted by their tokens, so rows with a long common prefix are neighbours, and taken
greedily into a group while the group's common prefix stays at least ``min_fraction`` of every member's length
(the engine's ``shared_prefix_min_fraction``, default 0.5). Rows sharing less are trained alone as before
(counted as ``prefix_fallback_rows``): at low sharing the packed mask would cost more than it saves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:  # the engine imports this module
    from harnessrl.trainer.engine import TrainRow


@dataclass(frozen=True)
class PrefixGroup:
    """Rows trained as one packed sequence: their first ``prefix`` tokens are equal and computed once."""

    rows: tuple[TrainRow, ...]
    prefix: int

    @property
    def index(self) -> int:  # for plan_micro_batches' deterministic order
        return min(r.index for r in self.rows)

    @property
    def num_tokens(self) -> int:
        """Length of the packed sequence: what the forward pass computes."""
        return self.prefix + sum(r.num_tokens - self.prefix for r in self.rows)

    @property
    def row_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def saved_tokens(self) -> int:
        """Tokens the rows hold that the packed sequence does not compute again."""
        return self.row_tokens - self.num_tokens


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def group_shared_prefixes(rows: Sequence[TrainRow], min_fraction: float
                          ) -> tuple[list[PrefixGroup], list[TrainRow]]:
    """Groups of rows that share at least ``min_fraction`` of each member's tokens, and the rows left alone.

    Deterministic: the same rows always give the same groups.
    """
    if not 0 < min_fraction <= 1:
        raise ValueError(f"min_fraction: {min_fraction} must be in (0, 1]")
    ordered = sorted(rows, key=lambda r: (np.asarray(r.input_ids, dtype=np.int64).astype(">i8").tobytes(), r.index))
    groups: list[PrefixGroup] = []
    alone: list[TrainRow] = []

    def close(members: list[TrainRow], prefix: int) -> None:
        if len(members) > 1:
            groups.append(PrefixGroup(tuple(members), prefix))
        else:
            alone.extend(members)

    members: list[TrainRow] = []
    prefix = longest = 0
    for row in ordered:
        if members:
            shared = min(prefix, common_prefix(members[-1].input_ids, row.input_ids))
            widest = max(longest, row.num_tokens)
            # at least one token of the prefix must stay: token 0 predicts nothing, but a group of
            # equal rows still needs a position to attend to
            if shared >= 1 and shared >= min_fraction * widest:
                members.append(row)
                prefix, longest = shared, widest
                continue
            close(members, prefix)
        members, prefix, longest = [row], row.num_tokens, row.num_tokens
    close(members, prefix)
    return groups, alone


def split_to_budget(group: PrefixGroup, token_budget: int) -> list[PrefixGroup | TrainRow]:
    """The group cut into packed sequences of at most ``token_budget`` tokens (each with the prefix once more);
    a piece of one row is that row, trained alone."""
    pieces: list[PrefixGroup | TrainRow] = []
    current: list[TrainRow] = []
    length = group.prefix
    for row in sorted(group.rows, key=lambda r: r.index):
        suffix = row.num_tokens - group.prefix
        if current and length + suffix > token_budget:
            pieces.append(PrefixGroup(tuple(current), group.prefix) if len(current) > 1 else current[0])
            current, length = [], group.prefix
        current.append(row)
        length += suffix
    pieces.append(PrefixGroup(tuple(current), group.prefix) if len(current) > 1 else current[0])
    return pieces


@dataclass(frozen=True)
class PackedLayout:
    """Where a group's rows lie in its packed sequence, and the mask and positions that keep them apart."""

    input_ids: np.ndarray  # int64 [T]
    segment: np.ndarray  # int64 [T]: 0 the prefix, k + 1 the suffix of row k
    position_ids: np.ndarray  # int64 [T]: each row's own positions
    starts: tuple[int, ...]  # packed index of each row's first suffix token

    def packed_index(self, k: int, positions: np.ndarray) -> np.ndarray:
        """Packed indices of row ``k``'s positions (a position inside the prefix is the shared one)."""
        prefix = int((self.segment == 0).sum())
        return np.where(positions < prefix, positions, self.starts[k] + positions - prefix)


def pack(group: PrefixGroup) -> PackedLayout:
    p = group.prefix
    ids = [np.asarray(group.rows[0].input_ids[:p], dtype=np.int64)]
    seg = [np.zeros(p, np.int64)]
    pos = [np.arange(p, dtype=np.int64)]
    starts = []
    at = p
    for k, row in enumerate(group.rows):
        suffix = np.asarray(row.input_ids[p:], dtype=np.int64)
        starts.append(at)
        ids.append(suffix)
        seg.append(np.full(len(suffix), k + 1, np.int64))
        pos.append(np.arange(p, p + len(suffix), dtype=np.int64))
        at += len(suffix)
    return PackedLayout(np.concatenate(ids), np.concatenate(seg), np.concatenate(pos), tuple(starts))


def shared_prefix_mask(segments: np.ndarray) -> np.ndarray:
    """``[B, 1, T, T]`` bool, True where query ``i`` may attend key ``j``, from ``[B, T]`` segment ids (-1:
    padding): causal, and the prefix (0) or the query's own segment. A padding query sees itself only, so no
    softmax row is empty (an empty one is NaN, and NaN times a zero gradient is still NaN)."""
    t = segments.shape[1]
    causal = np.tril(np.ones((t, t), dtype=bool))
    q = segments[:, :, None]
    k = segments[:, None, :]
    mask = causal[None] & (k >= 0) & ((k == 0) | (k == q)) & (q >= 0)
    mask |= np.eye(t, dtype=bool)[None]
    return mask[:, None]


# A packed sequence's blocks: (query start, query end, key ranges) per block, per batch row.
Blocks = tuple[tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...], ...]


def attention_blocks(layouts: Sequence[PackedLayout], length: int) -> Blocks:
    """Per packed batch row, which queries attend which key ranges: the prefix the prefix (causally), each
    suffix the prefix and itself, the padding itself (:func:`shared_prefix_attention`)."""
    blocks = []
    for layout in layouts:
        n, p = len(layout.input_ids), int((layout.segment == 0).sum())
        ends = (*layout.starts[1:], n)
        row: list[tuple[int, int, tuple[tuple[int, int], ...]]] = [(0, p, ((0, p),))]
        row += [(s, e, ((0, p), (s, e))) for s, e in zip(layout.starts, ends, strict=True) if e > s]
        if n < length:
            row.append((n, length, ((n, length),)))
        blocks.append(tuple(row))
    return tuple(blocks)


Attention = Callable[..., tuple[torch.Tensor, Any]]


def shared_prefix_attention(sdpa: Attention) -> Attention:
    """transformers' ``sdpa`` attention computed block by block for a packed batch (``shared_prefix_blocks``).

    SDPA under a dense ``[T, T]`` mask computes every query-key pair, the masked ones too (no causal block
    skipping): 8 rows sharing 80% of 1,024 tokens pack into 2,459 tokens, 6.0M pairs where the rows need 1.8M,
    and attention took 56% of the step's CPU time. Each block here is the prefix alone (causal, no mask: the
    kernel skips the upper triangle) or one suffix against the prefix and itself (its slice of the same mask),
    so the pairs computed are about the ones the rows need, and the result is the same attention (the mask
    still decides every pair). Without the keyword it is ``sdpa`` unchanged."""

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, *args: Any, shared_prefix_blocks: Blocks | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, Any]:
        if shared_prefix_blocks is None or attention_mask is None or attention_mask.dim() != 4:
            return sdpa(module, query, key, value, attention_mask, *args, **kwargs)
        outputs = []
        for b, blocks in enumerate(shared_prefix_blocks):
            pieces = []
            for q0, q1, ranges in blocks:
                if len(ranges) == 1 and ranges[0] == (0, q1) and q0 == 0:  # the prefix: causal, no mask
                    k, v, mask = key[b:b + 1, :, :q1], value[b:b + 1, :, :q1], None
                else:
                    cols = torch.cat([torch.arange(s, e, device=key.device) for s, e in ranges])
                    k, v = key[b:b + 1].index_select(2, cols), value[b:b + 1].index_select(2, cols)
                    mask = attention_mask[b:b + 1, :, q0:q1].index_select(3, cols)
                pieces.append(sdpa(module, query[b:b + 1, :, q0:q1], k, v, mask, *args, **kwargs)[0])
            outputs.append(torch.cat(pieces, dim=1))
        return torch.cat(outputs, dim=0), None

    return attention
