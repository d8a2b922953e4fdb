"""The search harness: an agent that answers a two-hop question by calling a ``search`` tool over a local corpus.

For one rollout (the pod/process contract: task file, ``OPENAI_BASE_URL``, ``HARNESSRL_WORKSPACE``):
1. Loads the corpus beside the tasks file into a BM25 index (``bm25s``; harnessrl.search.index).
2. Runs the loop with the plain ``openai`` client and function calling: the model calls ``search(query)``, gets
   the top documents as the tool result, and so on; its first reply without a tool call is its answer. The first
   ``--forced-searches`` calls name the tool in ``tool_choice`` (vLLM then constrains them to the schema, so
   even a random model searches); the rest are ``auto``. After ``--max-calls`` calls the last reply is the answer.
3. Writes the answer to ``$HARNESSRL_WORKSPACE/answer.txt`` and exits. The reward is the verifier's
   (``harnessrl search verify``: token F1 against the gold answer); this process never sees the reward token.

``--mode oracle`` is a scripted agent instead of the model: it searches the question, reads the bridge entity
from the top document, searches it with the relation's word and reads the answer there (every task must score
1: the corpus, the index and the verifier agree); ``--mode noop`` answers nothing (every task must score 0):
the checks that the pipeline is right while the tiny random model finds nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from openai import OpenAI

from harnessrl.search.index import SearchIndex
from harnessrl.search.verifier import ANSWER_FILE

HERE = Path(__file__).resolve().parent
SYSTEM = ("You answer questions about a corpus you do not know. Call the search tool to find documents, "
          "one fact at a time; when you know the answer, reply with the answer alone.")
TOOL = {"type": "function", "function": {
    "name": "search", "description": "BM25 search over the corpus; returns the best documents.", "strict": True,
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"],
                   "additionalProperties": False}}}


def load_task() -> dict:
    path = os.environ.get("HARNESSRL_TASK_FILE")
    return json.loads(Path(path).read_text() if path else os.environ["HARNESSRL_TASK"])


def run_agent(task: dict, index: SearchIndex, args: argparse.Namespace) -> str:
    client = OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ.get("OPENAI_API_KEY", "harnessrl"),
                    max_retries=2)
    model = os.environ.get("HARNESSRL_MODEL_NAME", "policy")
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}]
    answer = ""
    for call in range(args.max_calls):
        forced = call < args.forced_searches
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=[TOOL], max_tokens=args.max_tokens,
            tool_choice={"type": "function", "function": {"name": "search"}} if forced else "auto")
        message = reply.choices[0].message
        answer = message.content or ""
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        for tool_call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": tool_call.id,
                             "content": search_result(index, tool_call.function.arguments, args.top_k)})
    return answer


# The oracle's script, per question kind: what to read in the first hop's document, what to add to the bridge
# for the second search, what to read in the second hop's document.
ORACLE = {
    "birth-country": (r"was born in (\w+)\.", "country", r"in the country of (\w+)\."),
    "employer-seat": (r"works for ([\w ]+)\.", "headquarters", r"headquarters in the city of (\w+)\."),
}


def oracle_answer(task: dict, index: SearchIndex) -> str:
    """Two searches through the same index the model's tool uses, read by the script instead of a model."""
    bridge_pattern, relation, answer_pattern = ORACLE[task["kind"]]
    first = index.search(task["question"], 1)
    bridge = re.search(bridge_pattern, first[0]["text"]) if first else None
    if bridge is None:
        return ""
    second = index.search(f"{bridge.group(1)} {relation}", 1)
    found = re.search(answer_pattern, second[0]["text"]) if second else None
    return found.group(1) if found else ""


def search_result(index: SearchIndex, arguments: str, k: int) -> str:
    """The tool's answer: the documents found, or why the call was wrong (the model sees it, as a user would)."""
    try:
        query = json.loads(arguments)["query"]
    except (ValueError, KeyError, TypeError):
        return 'error: the arguments must be JSON like {"query": "..."}'
    found = index.search(str(query), k)
    return "\n".join(f"[{d['title']}] {d['text']}" for d in found) or "no documents match"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("agent", "oracle", "noop"), default="agent")
    parser.add_argument("--tasks-dir", type=Path, default=HERE, help="where the task's corpus file is")
    parser.add_argument("--max-calls", type=int, default=4, help="model calls per rollout")
    parser.add_argument("--forced-searches", type=int, default=1, help="first calls that must call search")
    parser.add_argument("--max-tokens", type=int, default=1024,
                        help="tokens per model call (in a run, the proxy forces spec.rollout.maxTokens instead)")
    parser.add_argument("--top-k", type=int, default=2, help="documents per search")
    args = parser.parse_args()
    task = load_task()["data"]
    workspace = Path(os.environ["HARNESSRL_WORKSPACE"])
    if args.mode == "noop":
        return 0
    index = SearchIndex.from_file(args.tasks_dir / task["corpus"])
    answer = oracle_answer(task, index) if args.mode == "oracle" else run_agent(task, index, args)
    workspace.mkdir(parents=True, exist_ok=True)
    (workspace / ANSWER_FILE).write_text(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
