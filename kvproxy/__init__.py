"""kvproxy: a KV-cache-aware reverse proxy for agentic LLM rollouts."""

__version__ = "0.1.0"
