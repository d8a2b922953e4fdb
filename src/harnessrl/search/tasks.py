"""The example's files: the corpus (JSONL, one document a line) and the tasks (the TrainingRun task format)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from harnessrl.search.corpus import generate


def write_example(output: Path, seed: int, count: int, people: int) -> tuple[int, int]:
    """Write ``count`` questions (shuffled under ``seed``) to ``output`` and their corpus to corpus.jsonl beside
    it; returns (documents, tasks)."""
    documents, questions = generate(seed, people)
    if count > len(questions):
        raise ValueError(f"--count {count}: {people} people give {len(questions)} questions; raise --people")
    chosen = random.Random(seed).sample(questions, count)
    output.parent.mkdir(parents=True, exist_ok=True)
    corpus = output.with_name("corpus.jsonl")
    corpus.write_text("".join(json.dumps(d.as_json()) + "\n" for d in documents))
    output.write_text("".join(json.dumps({"id": q.id, "data": {
        "question": q.question, "answer": q.answer, "kind": q.kind, "supporting": list(q.supporting),
        "corpus": corpus.name}}) + "\n" for q in chosen))
    return len(documents), len(chosen)
