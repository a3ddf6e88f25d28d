"""Locate the trace files shipped inside the servelab package (the README demo's default trace)."""

from __future__ import annotations

from pathlib import Path

import servelab

DEFAULT_TRACE = "azure_conv_2023.arrow"


def data_dir() -> Path:
    """The package's ``data`` folder (installed as package data beside ``servelab/__init__.py``)."""
    return Path(servelab.__file__).resolve().parent / "data"


def default_trace_path() -> Path:
    """The whole Azure LLM inference trace 2023 (conversation), 19,366 requests, as a servelab trace."""
    return data_dir() / DEFAULT_TRACE
