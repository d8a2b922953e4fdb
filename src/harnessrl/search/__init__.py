"""The search example's parts: a generated corpus, multi-hop questions over it, a BM25 index and the reward."""
