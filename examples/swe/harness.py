"""The coding harness: mini-swe-agent, unchanged, fixing a bug in a real library, its commands in the sandbox.

What it does for one rollout (the pod/process contract: task file, ``OPENAI_BASE_URL``, ``HARNESSRL_WORKSPACE``):
1. Puts the task's repository in the workspace: the library's source distribution with the task's bug
   (``$HARNESSRL_WORKSPACE/repo/<root>``); a throwaway copy, one per rollout.
2. Runs mini-swe-agent (``mini``, from its own environment: ``scripts/swe-agent.sh``) on the task's problem
   statement, with its model on ``OPENAI_BASE_URL`` (litellm's ``openai/`` provider: function calling with its
   one ``bash`` tool) and its bubblewrap environment, whose executable is ``harnessrl swe sandbox``: every
   command the model writes runs there, in the repository copy, with no network, a time limit, and memory and
   process limits. Nothing the model writes runs on the host. ``--tool-choice`` sets the ``tool_choice`` of its
   calls through its own config (``model_kwargs``, sent on every call); the proxy forces sampling fields only,
   since when to force a tool is the harness's choice (an agent library may force one call and not the next).
3. Exits. The reward is the verifier's (``harnessrl swe verify``, spec.harness.verifier): this process never
   sees the reward URL or its token.

``--mode oracle`` applies the task's known fix instead of running the agent (every task must then score 1),
``--mode noop`` leaves the bug in place (every task must score 0): the checks that the pipeline is right while
the tiny random model fixes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from harnessrl.swe.repository import apply_patch
from harnessrl.swe.workspace import prepare_workspace

HERE = Path(__file__).resolve().parent
MINI = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "harnessrl/mini-swe-agent-2.4.6/bin/mini"


def load_task() -> dict:
    path = os.environ.get("HARNESSRL_TASK_FILE")
    return json.loads(Path(path).read_text() if path else os.environ["HARNESSRL_TASK"])


# mini-swe-agent's one tool (its ``BASH_TOOL``); ``--tool-choice bash`` names it.
AGENT_TOOL = "bash"
# ``--tool-choice`` -> the ``tool_choice`` every call of mini-swe-agent sends (its ``model_kwargs`` go to each
# litellm call); ``auto`` sends none, so the server's default (auto) holds, as in mini-swe-agent's own config.
TOOL_CHOICES: dict[str, object] = {
    "auto": None,
    "required": "required",
    AGENT_TOOL: {"type": "function", "function": {"name": AGENT_TOOL}},
}


def agent_config(repository: Path, args: argparse.Namespace) -> dict:
    """mini-swe-agent's settings (merged over its own mini.yaml): no prompts, its bubblewrap environment with
    harnessrl's sandbox as the executable, and the run's model on OPENAI_BASE_URL with ``--tool-choice``."""
    harnessrl = Path(sys.executable).with_name("harnessrl")
    model_kwargs = {"api_base": os.environ["OPENAI_BASE_URL"],
                    "api_key": os.environ.get("OPENAI_API_KEY", "harnessrl"), "num_retries": 0}
    if TOOL_CHOICES[args.tool_choice] is not None:
        model_kwargs["tool_choice"] = TOOL_CHOICES[args.tool_choice]
    return {
        "agent": {"agent_class": "default", "step_limit": args.step_limit, "cost_limit": 0,
                  "wall_time_limit_seconds": args.wall_time},
        "model": {
            "model_class": "litellm",
            "model_name": f"openai/{os.environ.get('HARNESSRL_MODEL_NAME', 'policy')}",
            "cost_tracking": "ignore_errors",
            "model_kwargs": model_kwargs,
        },
        "environment": {
            "environment_class": "bubblewrap",
            "executable": str(harnessrl),
            "wrapper_args": ["swe", "sandbox", "--timeout", str(args.command_timeout), "--"],
            "cwd": str(repository),
            "timeout": args.command_timeout + 30,  # the sandbox's own limit kills first, with its reason
        },
    }


def run_agent(task: dict, repository: Path, workspace: Path, args: argparse.Namespace) -> int:
    mini = Path(os.environ.get("HARNESSRL_MINI_SWE_AGENT", MINI))
    if not mini.is_file():
        sys.exit(f"{mini} not found: run scripts/swe-agent.sh (or set HARNESSRL_MINI_SWE_AGENT)")
    config = workspace / "agent.yaml"
    config.write_text(yaml.safe_dump(agent_config(repository, args)))
    env = {**os.environ, "MSWEA_CONFIGURED": "1", "MSWEA_SILENT_STARTUP": "1",
           "MSWEA_GLOBAL_CONFIG_DIR": str(workspace / "mini-config"), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    command = [str(mini), "--yolo", "--exit-immediately", "-c", "mini.yaml", "-c", str(config),
               "-o", str(workspace / "trajectory.json"), "-t", task["problem_statement"]]
    return subprocess.run(command, env=env, stdin=subprocess.DEVNULL, check=False).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("agent", "oracle", "noop"), default="agent")
    parser.add_argument("--tasks-dir", type=Path, default=HERE, help="where the tasks file and repos/ are")
    parser.add_argument("--step-limit", type=int, default=10, help="model calls per rollout")
    parser.add_argument("--command-timeout", type=int, default=60, help="seconds per sandboxed command")
    parser.add_argument("--wall-time", type=int, default=0, help="seconds for the agent (0: the run's timeout)")
    parser.add_argument("--tool-choice", choices=tuple(TOOL_CHOICES), default="auto",
                        help="tool_choice of every call: auto (none sent), required (some tool call), or "
                        f"{AGENT_TOOL} (a call of mini-swe-agent's one tool, decoded into its arguments' schema)")
    args = parser.parse_args()
    task = load_task()["data"]
    workspace = Path(os.environ["HARNESSRL_WORKSPACE"])
    repository = prepare_workspace(task, args.tasks_dir, workspace)
    if args.mode == "oracle":
        apply_patch(repository, task["patch"])
        return 0
    if args.mode == "noop":
        return 0
    return run_agent(task, repository, workspace, args)


if __name__ == "__main__":
    sys.exit(main())
