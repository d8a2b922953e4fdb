"""Coding-agent tasks from real libraries: generation, the sandbox, the verifier (issue 24)."""
