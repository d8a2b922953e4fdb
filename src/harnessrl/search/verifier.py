"""The reward of a search rollout: token F1 between the answer the harness left and the task's gold answer.

The harness writes its final answer to ``$HARNESSRL_WORKSPACE/answer.txt`` and exits; this verifier
(``harnessrl search verify``, spec.harness.verifier) scores it and alone holds the reward URL and token, so the
harness cannot post a reward of its own. The reward is token F1 (SQuAD's, after normalization), so a partly
right answer gets partial credit; exact match is in the reward's info. A missing answer scores 0.
"""

from __future__ import annotations

from pathlib import Path

from harnessrl.search.reward import exact_match, token_f1
from harnessrl.swe import verifier as swe_verifier
from harnessrl.swe.verifier import Verdict

ANSWER_FILE = "answer.txt"
MAX_ANSWER_CHARS = 2000  # a longer answer is cut: F1 over a whole essay would reward listing every name


def verify(task: dict, workspace: Path) -> Verdict:
    path = workspace / ANSWER_FILE
    # A link could point the verifier, which may read more than the harness, at another file: no answer.
    answered = path.is_file() and not path.is_symlink()
    answer = path.read_text(errors="replace")[:MAX_ANSWER_CHARS] if answered else ""
    return Verdict(token_f1(answer, task["answer"]), {
        "exact_match": exact_match(answer, task["answer"]), "answer": answer[:200], "gold": task["answer"],
        "answered": answered})


def verify_from_environment() -> int:
    """``harnessrl search verify``: the verifier contract as ``harnessrl swe verify`` reads and answers it."""
    return swe_verifier.verify_from_environment(verify)
