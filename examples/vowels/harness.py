"""A small multi-turn agent harness that the tiny random model can learn to please.

It is deliberately an ordinary harness: the plain ``openai`` client, a task read from the pod/process contract
(``HARNESSRL_TASK_FILE`` or ``HARNESSRL_TASK``), two model calls with a tool result between them, and one reward
posted to the proxy's ``/v1/reward`` at the end. Nothing in it knows about training.

Reward: the share of vowels (a, e, i, o, u) among the visible characters of the model's two answers. A random
model writes about one vowel in six by chance, so the signal exists from step 0, and RL can raise it a lot
(single-vowel tokens exist), which makes learning easy to see.
"""

from __future__ import annotations

import json
import os
import sys

import httpx
from openai import OpenAI


def load_task() -> dict:
    path = os.environ.get("HARNESSRL_TASK_FILE")
    if path:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    raw = os.environ.get("HARNESSRL_TASK")
    if raw:
        return json.loads(raw)
    sys.exit("no task: set HARNESSRL_TASK_FILE or HARNESSRL_TASK")


VOWELS = frozenset("aeiouAEIOU")


def vowel_share(text: str) -> float:
    visible = [c for c in text if not c.isspace()]
    return sum(c in VOWELS for c in visible) / len(visible) if visible else 0.0


def count_tool(text: str) -> str:
    """The 'tool': tells the agent how it did, like a test runner would."""
    vowels = sum(c in VOWELS for c in text)
    return f"tool count_vowels: {vowels} vowels in {len(text)} characters. Use more vowels."


def main() -> int:
    task = load_task()["data"]  # a TrainingRun task: {"id": ..., "data": {...}}
    base_url = os.environ["OPENAI_BASE_URL"]
    client = OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"), max_retries=2)
    model = os.environ.get("HARNESSRL_MODEL_NAME", task.get("model", "policy"))
    max_tokens = int(task.get("max_tokens", 24))

    messages = [
        {"role": "system", "content": "You are a writing agent. Answer with words."},
        {"role": "user", "content": task["prompt"]},
    ]
    answers = []
    for turn in range(int(task.get("turns", 2))):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens)
        text = reply.choices[0].message.content or ""
        answers.append(text)
        messages.append({"role": "assistant", "content": text})
        # The tool result goes back as a user turn: the tiny model has no tool-call format to answer to.
        messages.append({"role": "user", "content": count_tool(text)})

    reward = sum(vowel_share(a) for a in answers) / len(answers)
    httpx.post(base_url.rstrip("/") + "/reward",
               json={"value": reward, "info": {"answers": answers}}, timeout=30).raise_for_status()
    print(json.dumps({"reward": reward}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
