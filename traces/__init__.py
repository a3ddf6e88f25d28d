"""servelab.traces: the request-trace format, importers, generators, transforms and statistics.

Public names are re-exported lazily (PEP 562), so ``import servelab.traces.io`` does not pull in
polars or scipy for callers that only read traces.
"""

from __future__ import annotations

from servelab.common.lazy import lazy_exports

_EXPORTS = {
    "read_trace": "servelab.traces.io",
    "write_trace": "servelab.traces.io",
    "trace_sha256": "servelab.traces.io",
    "validate": "servelab.traces.schema",
    "SCHEMA_VERSION": "servelab.traces.schema",
    "synth_trace": "servelab.traces.synth",
    "SynthConfig": "servelab.traces.synth",
    "generate": "servelab.traces.synth",
    "import_trace": "servelab.traces.importers",
    "trace_info": "servelab.traces.info",
    "scale_rate": "servelab.traces.transforms",
    "default_trace_path": "servelab.traces.bundled",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
