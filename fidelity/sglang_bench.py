"""SGLang ``python -m sglang.bench_serving --output-file F --output-details`` results (client side).

Each run appends one JSON object as a line of the output file: the summary (``backend``,
``request_rate``, ``max_concurrency``, ``mean_e2e_latency_ms``, ...) and, with ``--output-details``,
the per-request lists ``input_lens``, ``output_lens``, ``ttfts``, ``itls``, ``generated_texts`` and
``errors``. The lists are vLLM bench's older ones (fidelity/vllm_bench.py reads them): no
``start_times`` and no ``latencies``, so a latency is the TTFT plus the chunk gaps, and the sends are
known only where the client did not pace them (``--request-rate inf``: all at once, or with
``--max-concurrency`` C each request as one of the C slots freed); a paced run's are drawn from its
Poisson process, fitted to the run's duration (vllm_bench._paced_sends). A file of several runs (one per
line) is a sweep: one run each, or ``--benchmark N`` for the N-th (0-based).
"""

from __future__ import annotations

from pathlib import Path

from servelab.common.errors import InputError
from servelab.common.sniff import detects
from servelab.fidelity.base import IMPORTERS, Measured
from servelab.fidelity.fields import json_lines
from servelab.fidelity.vllm_bench import Client, measured_from_result

SGLANG = Client("SGLang bench_serving", "SGLang bench_serving records none",
                "rerun bench_serving with --request-rate inf (all at once) or --max-concurrency C",
                "rerun bench_serving with --output-file F --output-details")


def _is_sglang(probe) -> bool:
    """A JSON line with SGLang's summary keys (its E2E mean is ``mean_e2e_latency_ms``; vLLM's is
    ``mean_e2el_ms``), or a run against an SGLang server."""
    return probe.line.lstrip().startswith("{") and (
        '"mean_e2e_latency_ms"' in probe.line or '"backend": "sglang' in probe.line)


def runs(path: Path) -> list[tuple[int, dict]]:
    """(line number, result) for each non-empty line."""
    return json_lines(path, "bench_serving result")


def count_benchmarks(path: Path) -> int:
    """How many runs the file holds (bench_serving appends one line per run)."""
    return len(runs(path))


@IMPORTERS.register("sglang-bench")
@detects(_is_sglang, order=35)
def import_sglang_bench(paths: list[Path], benchmark: int | None = None) -> Measured:
    if len(paths) != 1:
        raise InputError(paths[1], "sglang-bench takes one bench_serving output file")
    path = paths[0]
    results = runs(path)
    index = benchmark or 0
    if benchmark is not None:
        if not 0 <= benchmark < len(results):
            raise InputError(path, f"--benchmark {benchmark}: the file has runs 0..{len(results) - 1} (one per line)")
        results = [results[benchmark]]
    elif len(results) > 1:
        raise InputError(path, f"{len(results)} bench_serving runs (one per line): pass --benchmark N for one")
    if not results:
        raise InputError(path, "no bench_serving result in it")
    lineno, doc = results[0]
    try:
        measured = measured_from_result(path, doc, SGLANG)
    except InputError as err:  # which of the file's runs
        raise InputError(path, f"run {index} (line {lineno}): {err.rule}", column=err.column, row=err.row) from None
    source = dict(measured.source, line=lineno)
    notes = tuple(n.replace("and detokenisation", "and detokenisation (SGLang bench_serving)")
                  for n in measured.notes)
    from dataclasses import replace

    return replace(measured, source=source, notes=notes)
