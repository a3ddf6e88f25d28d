"""servelab: replay LLM-serving request traces against scheduling policies and cost models."""

__version__ = "0.1.0"
