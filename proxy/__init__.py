"""Trace-capture proxy: an OpenAI-compatible endpoint that records every call token-exactly."""
