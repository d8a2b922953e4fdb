"""Token texts for the token view, from the model's ``tokenizer.json`` alone (no model code, no torch)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

TOKEN_PAGE = 2000  # tokens of one row rendered at once: a 100k-token call stays responsive


@lru_cache(maxsize=4)
def load_tokenizer(directory: str) -> Any | None:
    """The model's ``tokenizer.json`` (the ``tokenizers`` library, no model code), or None when absent."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(str(path))


def token_texts(tokenizer: Any | None, ids: np.ndarray) -> list[str] | None:
    """Each token decoded on its own (bytes that are not whole characters show as U+FFFD)."""
    if tokenizer is None or not ids.size:
        return None
    return tokenizer.decode_batch([[int(i)] for i in ids], skip_special_tokens=False)


