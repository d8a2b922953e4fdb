"""PrefixDigestCache gives exactly ``delta.prefix_digests`` whatever the next call's messages are, hashes a
growing conversation's messages once, and holds bounded memory."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.store import CallRecord, delta, prepare_call
from harnessrl.store.digest_cache import PrefixDigestCache

# Values whose JSON text differs although Python's == holds between some of them, so a cache that trusted
# == would hand out a wrong digest.
scalars = st.sampled_from([1, 1.0, True, 0, 0.0, -0.0, False, None, "1", "a", float("nan"), 2**70])
json_values = st.recursive(
    scalars | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3),
    max_leaves=6,
)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "tool"]), "content": json_values})
moves = st.sampled_from(["grow", "grow", "grow", "edit", "reorder", "shrink", "unrelated", "mutate", "same"])


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.data())
def test_digests_equal_a_full_pass_for_any_next_list(data: st.DataObject) -> None:
    cache = PrefixDigestCache()
    items: list[Any] = data.draw(st.lists(message, max_size=3))
    for _ in range(data.draw(st.integers(min_value=1, max_value=8))):
        key = data.draw(st.sampled_from(["a", "a", "a", "b"]))
        assert cache.digests(key, items) == delta.prefix_digests(items)
        move = data.draw(moves)
        if move == "grow":
            items = items + data.draw(st.lists(message, min_size=1, max_size=3))
        elif move == "edit" and items:  # a new list whose item i differs (the caller's old list untouched)
            i = data.draw(st.integers(min_value=0, max_value=len(items) - 1))
            items = items[:i] + [data.draw(message)] + items[i + 1 :]
        elif move == "reorder" and items:  # same keys and values, other key order: other JSON text
            i = data.draw(st.integers(min_value=0, max_value=len(items) - 1))
            items = items[:i] + [dict(reversed(list(items[i].items())))] + items[i + 1 :]
        elif move == "shrink":
            items = items[: data.draw(st.integers(min_value=0, max_value=len(items)))]
        elif move == "unrelated":
            items = data.draw(st.lists(message, max_size=4))
        elif move == "mutate" and items:  # the caller changes the very objects the cache saw
            i = data.draw(st.integers(min_value=0, max_value=len(items) - 1))
            items[i]["content"] = data.draw(json_values)
    assert cache.digests("a", items) == delta.prefix_digests(items)


def _turns(n: int, width: int = 40) -> list[dict[str, Any]]:
    return [{"role": "user" if i % 2 else "assistant", "content": f"turn {i} " + "x" * width} for i in range(n)]


def test_a_growing_conversation_hashes_each_message_once() -> None:
    cache = PrefixDigestCache()
    final = _turns(60)
    for n in range(1, 61, 3):  # each call sends fresh objects, as parsed from a new request body
        fresh = [dict(m) for m in final[:n]]
        assert cache.digests(("run", "r1", 0), fresh) == delta.prefix_digests(fresh)
    assert cache.hashed_items == 58  # 1 + 3 + 3 + ... : every message once
    rewritten = [dict(m) for m in final[:58]] + [{"role": "assistant", "content": "rewritten"}, final[0]]
    assert cache.digests(("run", "r1", 0), rewritten) == delta.prefix_digests(rewritten)
    assert cache.hashed_items == 58 + 2  # resumed before the rewritten item


def test_values_that_compare_equal_but_serialise_differently_never_share_a_state() -> None:
    cache = PrefixDigestCache()
    for content in (1, 1.0, True, 0.0, -0.0, 0, False, {"a": 1, "b": 2}, {"b": 2, "a": 1}):
        items = [{"role": "system", "content": "s"}, {"role": "user", "content": content}]
        assert cache.digests("k", items) == delta.prefix_digests(items)


def test_values_json_writes_but_the_cache_does_not_keep_are_hashed_in_full() -> None:
    class Text(str):
        pass

    cache = PrefixDigestCache()
    for items in ([{"content": (1, 2)}], [{"content": float("nan")}], [{"content": Text("x")}], [{1: "x"}]):
        assert cache.digests("k", items) == delta.prefix_digests(items)
        assert cache.digests("k", items) == delta.prefix_digests(items)
    assert cache.held_entries == 0


def test_memory_stays_within_the_entry_and_byte_bounds() -> None:
    cache = PrefixDigestCache(max_entries=50, max_bytes=200_000, per_key=2)
    for key in range(400):
        for n in (5, 10, 15):
            cache.digests(key, _turns(n))
        cache.digests(key, _turns(3, width=7))  # a second conversation under the same key
        cache.digests(key, _turns(4, width=9))  # a third: the oldest of the key goes
        assert cache.held_entries <= 50 and cache.held_bytes <= 200_000
    assert 0 < cache.held_entries and 0 < cache.held_bytes
    assert sum(len(entries) for entries in cache._table.values()) == cache.held_entries
    assert all(len(entries) <= 2 for entries in cache._table.values())
    big = _turns(2, width=300_000)  # larger than the whole bound: returned right, not kept
    assert cache.digests("big", big) == delta.prefix_digests(big)
    assert cache.held_bytes <= 200_000
    for key in list(cache._table):
        cache.forget(key)
    assert cache.held_entries == 0 and cache.held_bytes == 0


def test_threads_sharing_a_cache_get_exact_digests() -> None:
    cache = PrefixDigestCache(max_entries=8)
    final = _turns(40, width=5)
    wrong: list[int] = []

    def conversation(worker: int) -> None:
        for n in range(1, 41):
            items = final[:n] if n % 7 else final[: n // 2]
            if cache.digests(worker % 3, items) != delta.prefix_digests(items):
                wrong.append(worker)

    threads = [threading.Thread(target=conversation, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
    assert sum(len(entries) for entries in cache._table.values()) == cache.held_entries


def test_prepare_call_with_the_cache_stores_the_same_digests() -> None:
    cache = PrefixDigestCache()
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    for seq in range(4):
        messages = messages + [{"role": "user", "content": f"q{seq}"}]
        reply = {"role": "assistant", "content": f"a{seq}"}
        record = CallRecord(
            call_id=f"c{seq}", run="run", rollout_id="r", attempt=0, seq=seq, route="chat",
            request={"messages": messages}, response={"choices": [{"message": reply}]},
            prompt_token_ids=[1, 2], completion_token_ids=[3], logprobs=[-0.5], policy_version=0,
            upstream="u", latency_s=0.1, created_at=datetime.now(UTC),
        )  # fmt: skip
        cached, plain = prepare_call(record, digests=cache), prepare_call(record)
        assert (cached.anchor, cached.input_digests) == (plain.anchor, plain.input_digests)
        messages = messages + [reply]
    assert cache.hashed_items == 1 + 4 * 2  # the system prompt, then each question and reply once
