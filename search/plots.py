"""Draw a study with optuna.visualization.matplotlib: history, importances, parallel coordinates, Pareto front, intermediate values."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable

from servelab.common.atomic import atomic_path


def _save(ax, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
    fig.set_size_inches(max(fig.get_size_inches()[0], 8), max(fig.get_size_inches()[1], 5))
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return path


def plot_study(study, out_dir: Path) -> tuple[list[Path], list[str]]:
    """Write the PNGs that apply to this study; returns (written paths, notes on the ones skipped)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as ovm
    from optuna.trial import TrialState

    out_dir = Path(out_dir)
    names = study.user_attrs.get("objectives") or [f"value_{i}" for i in range(len(study.directions))]
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    written: list[Path] = []
    skipped: list[str] = []
    if not complete:
        return written, ["every plot: no complete trial yet"]
    multi = len(names) > 1
    targets: list[tuple[str, Callable | None, str]] = (
        [(n, (lambda t, i=i: t.values[i]), n) for i, n in enumerate(names)] if multi else [(names[0], None, names[0])]
    )
    params = {p for t in complete for p in t.params}

    def attempt(label: str, path: Path, draw: Callable) -> None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # optuna marks the matplotlib backend experimental
                ax = draw()
            written.append(_save(ax, path))
        except (ValueError, RuntimeError, ZeroDivisionError) as err:
            plt.close("all")
            skipped.append(f"{label}: {err}")

    for suffix, target, tname in targets:
        tag = f"_{suffix}" if multi else ""
        attempt(f"history{tag}", out_dir / f"history{tag}.png",
                lambda: ovm.plot_optimization_history(study, target=target, target_name=tname))  # fmt: skip
        if len(params) >= 2 and len(complete) >= 2:
            attempt(f"importances{tag}", out_dir / f"importances{tag}.png",
                    lambda: ovm.plot_param_importances(study, target=target, target_name=tname))  # fmt: skip
        else:
            skipped.append(f"importances{tag}: needs two parameters and two complete trials")
        attempt(f"parallel{tag}", out_dir / f"parallel{tag}.png",
                lambda: ovm.plot_parallel_coordinate(study, target=target, target_name=tname))  # fmt: skip
    if multi:
        attempt("pareto", out_dir / "pareto.png", lambda: ovm.plot_pareto_front(study, target_names=names))
    else:
        skipped.append("pareto: a single-objective study has no Pareto front")
    if any(t.intermediate_values for t in study.get_trials(deepcopy=False)):
        attempt("intermediate", out_dir / "intermediate.png", lambda: ovm.plot_intermediate_values(study))
    return written, skipped


__all__ = ["plot_study"]
