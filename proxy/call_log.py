"""One log line per LLM call, as users of proxies expect (nginx, LiteLLM and uvicorn log every request).

The lines go to the logger ``harnessrl.proxy.calls`` at INFO, so ``harnessrl proxy`` prints them by default;
``--no-log-calls`` (or ``--log-level WARNING``) silences them. Each line says whose call it was (rollout,
attempt, its number in the attempt), how it ended (status, HTTP status), its tokens and its latency::

    call r-7/0 #3 chat ok 200 prompt 1534 completion 212 tokens 2.31 s

A call stored without token arrays (observe mode, an error) shows the usage the server reported, marked
``(usage)``, so a log reader never takes a zero for what the model did.

A request the proxy answers itself with an error (a refused field, a pause, an unknown route: no upstream
answer, so no call) is logged on the same logger at WARNING, with its rollout and the error's code::

    refused r-7/0 messages 400 invalid_request_error: 'messages[6].content[1]' is a image block ...
"""

from __future__ import annotations

import logging

from harnessrl.store.records import CallRecord

from .protocol import usage_tokens

CALL_LOGGER = "harnessrl.proxy.calls"
log = logging.getLogger(CALL_LOGGER)


def log_call(record: CallRecord) -> None:
    """Log ``record`` (cheap when the logger is off: nothing is formatted)."""
    if not log.isEnabledFor(logging.INFO):
        return
    prompt, completion, source = len(record.prompt_token_ids), len(record.completion_token_ids), ""
    if not prompt and not completion and record.response:
        prompt, completion = usage_tokens(record.response)
        source = " (usage)"
    log.info("call %s/%d #%d %s %s %d prompt %d completion %d tokens%s %.2f s", record.rollout_id,
             record.attempt, record.seq, record.route, record.status.value, record.http_status, prompt,
             completion, source, record.latency_s)


def log_refusal(who: str, route: str, status: int, code: str, message: str) -> None:
    """Log an error answer the proxy made itself (``who``: "rollout/attempt", or "-" when unattributed)."""
    log.warning("refused %s %s %d %s: %s", who, route, status, code, message.splitlines()[0] if message else "")
