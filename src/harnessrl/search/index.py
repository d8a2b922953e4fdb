"""BM25 over the corpus with ``bm25s`` (English stop words, no stemming: the names are invented)."""

from __future__ import annotations

import json
from pathlib import Path

import bm25s


class SearchIndex:
    def __init__(self, documents: list[dict]):
        self.documents = documents
        self._retriever = bm25s.BM25()
        self._retriever.index(bm25s.tokenize([f"{d['title']} {d['text']}" for d in documents],
                                             stopwords="en", show_progress=False), show_progress=False)

    @classmethod
    def from_file(cls, path: Path) -> SearchIndex:
        return cls([json.loads(line) for line in path.read_text().splitlines() if line.strip()])

    def search(self, query: str, k: int = 3) -> list[dict]:
        """The ``k`` best documents, best first; none when no query word is in the corpus."""
        tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
        if not tokens.ids[0]:
            return []
        ids, scores = self._retriever.retrieve(tokens, k=min(k, len(self.documents)), show_progress=False)
        return [self.documents[i] for i, score in zip(ids[0], scores[0], strict=True) if score > 0]
