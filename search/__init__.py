"""servelab.search: Optuna studies over engine settings, scored by SLO attainment, goodput or cost.

    from servelab.search import load_spec, run_study
    run_study(load_spec("examples/search_attainment.toml"), "studies/att")

Names are re-exported lazily, so importing the package does not pull in optuna.
"""

from __future__ import annotations

from servelab.common.lazy import lazy_exports

_EXPORTS = {
    "load_spec": "servelab.search.spec",
    "parse_spec": "servelab.search.spec",
    "SearchSpec": "servelab.search.spec",
    "run_study": "servelab.search.study",
    "run_worker": "servelab.search.study",
    "open_study": "servelab.search.study",
    "trials_table": "servelab.search.trials",
    "write_best_toml": "servelab.search.trials",
    "load_study_dir": "servelab.search.trials",
    "plot_study": "servelab.search.plots",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
