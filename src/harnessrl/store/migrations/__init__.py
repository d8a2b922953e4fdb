"""Alembic migrations for the trace store."""
