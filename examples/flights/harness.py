"""A function-calling agent written with the `openai-agents` SDK, trained as it is.

The harness is what a user of the SDK writes anyway: an ``Agent`` with two ``@function_tool`` functions, run by
``Runner.run`` on the SDK's Chat Completions model (``OpenAIChatCompletionsModel``) with an ``AsyncOpenAI``
client pointed at ``OPENAI_BASE_URL`` (the run's capture proxy). Nothing in it knows about training, apart from
reading its task and posting one reward.

The conversation, one per rollout: the user asks for a flight; the agent must call ``find`` (the request's
``tool_choice`` names it; the SDK resets it to "auto" after the call), gets the tool's answer and replies; the
user says what to book; the agent must call ``book``, gets the confirmation and replies. Usually four model
calls (a forced call cut off at ``max_tokens`` is the SDK's final answer for its turn; a reply that calls a
tool gets another turn, up to ``MAX_TURNS``), each resending the whole history (tools included), so the proxy
continues every call from the previous one's exact tokens and the rollout trains as one row.

Why forced calls: a random model does not choose to call a tool, but with ``tool_choice`` naming the function
vLLM constrains decoding to the tool-call format and (the SDK's tools are ``strict``) to the argument schema,
so even the tiny random model makes valid calls. The arguments are enums, which keeps the calls short.

Reward: the share of the four arguments (``to``, ``day``; ``seats``, ``cabin``) that match the request. A
random model picks each from two or three values, and sometimes fills the JSON with so much whitespace that
the call is cut off at ``max_tokens`` (then it is no call, and its arguments score 0), so rewards vary within a
group from step 0 (GRPO's signal). A policy that keeps its calls short and reads the request scores 1.0.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Literal

import httpx
from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunConfig,
    Runner,
    function_tool,
)
from openai import AsyncOpenAI

City = Literal["Rome", "Oslo", "Paris"]
Day = Literal["Mon", "Tue", "Fri"]
Cabin = Literal["eco", "first"]
FIELDS = ("to", "day", "seats", "cabin")  # the task's answer, one field per argument
MAX_TURNS = 3  # per Runner.run: the forced call, the reply, and one spare in case the reply calls a tool too


def load_task() -> dict:
    """This rollout's task, ``{"id": ..., "data": {...}}``: the file HARNESSRL_TASK_FILE, else HARNESSRL_TASK."""
    path = os.environ.get("HARNESSRL_TASK_FILE")
    raw = Path(path).read_text(encoding="utf-8") if path else os.environ.get("HARNESSRL_TASK")
    if not raw:
        sys.exit("no task: set HARNESSRL_TASK_FILE or HARNESSRL_TASK")
    return json.loads(raw)


calls: list[tuple[str, dict[str, str | int]]] = []  # every tool call the agent made, as (tool, arguments)


@function_tool
def find(to: City, day: Day) -> str:
    """Find a flight.

    Args:
        to: the city to fly to.
        day: the day to fly.
    """
    calls.append(("find", {"to": to, "day": day}))
    return f"Flight HR{100 + 7 * len(to) + len(day)} to {to} on {day}, 09:40."


@function_tool
def book(seats: Literal[1, 2, 3], cabin: Cabin) -> str:
    """Book the flight found last.

    Args:
        seats: how many seats.
        cabin: the cabin class.
    """
    calls.append(("book", {"seats": seats, "cabin": cabin}))
    return f"Booked {seats} seat(s) in {cabin}. Confirmation K7Q2."


def reward(want: dict[str, str | int]) -> float:
    """The share of the request's fields that the agent's last call of each tool got right (0 if never called)."""
    made: dict[str, str | int] = {}
    for _, arguments in calls:
        made.update(arguments)
    return sum(made.get(name) == want[name] for name in FIELDS) / len(FIELDS)


async def converse(task: dict, client: AsyncOpenAI, model_name: str) -> None:
    """Two user turns, each answered by one forced tool call and a free reply."""
    max_tokens = int(task.get("max_tokens", 80))
    model = OpenAIChatCompletionsModel(model=model_name, openai_client=client)
    agent = Agent(
        name="travel desk",
        instructions="You book flights. Use the tools.",
        tools=[find, book],
        model=model,
    )
    config = RunConfig(tracing_disabled=True)  # the SDK's traces would go to OpenAI's servers
    history: list = [{"role": "user", "content": task["request"]}]
    for tool, follow_up in (("find", None), ("book", task["follow_up"])):
        if follow_up:
            history.append({"role": "user", "content": follow_up})
        # tool_choice names the function for this turn's first call; the SDK resets it to "auto" after the
        # call (reset_tool_choice), so the agent then answers in text.
        forced = agent.clone(model_settings=ModelSettings(tool_choice=tool, max_tokens=max_tokens))
        try:
            result = await Runner.run(forced, history, max_turns=MAX_TURNS, run_config=config)
        except MaxTurnsExceeded:  # the reply kept calling tools: the calls made still count
            return
        history = result.to_input_list()


def main() -> int:
    task = load_task()["data"]  # a TrainingRun task: {"id": ..., "data": {...}}
    base_url = os.environ["OPENAI_BASE_URL"]
    client = AsyncOpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"), max_retries=2)
    asyncio.run(converse(task, client, os.environ.get("HARNESSRL_MODEL_NAME", "policy")))
    value = reward(task["want"])
    info = {"calls": [{"tool": name, "arguments": arguments} for name, arguments in calls]}
    httpx.post(base_url.rstrip("/") + "/reward", json={"value": value, "info": info}, timeout=30).raise_for_status()
    print(json.dumps({"reward": value, **info}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
