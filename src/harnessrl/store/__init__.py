"""The trace store: runs, tasks, rollouts and every captured LLM call, on SQLite or PostgreSQL."""
