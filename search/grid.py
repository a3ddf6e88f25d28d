"""The grid sampler of a resumable study: Optuna's GridSampler, except that a point whose trial failed in an earlier run is run again.

Optuna counts a failed trial's grid point as visited, so a study resumed after Ctrl-C, a killed
worker or an error never ran that point: once the trial numbers passed the grid's size, it found
no unvisited point and evaluated a random one again. Here a point is visited when a trial of it
completed or was pruned (infeasible included), is running, or failed in this run (an error that
would only fail again); a failure from before this run leaves its point to be tried once more.
Imported only where a grid sampler is made (it subclasses Optuna's, which is imported lazily).
"""

from __future__ import annotations

from optuna.samplers import GridSampler
from optuna.trial import TrialState


class ResumableGridSampler(GridSampler):
    """GridSampler whose failed points from an earlier run are unvisited again (search/grid.py's docstring)."""

    def __init__(self, search_space, seed: int | None = None) -> None:
        super().__init__(search_space, seed=seed)
        self._first_number: int | None = None  # the first trial this sampler placed: failures before it are earlier runs'

    def before_trial(self, study, trial) -> None:
        if self._first_number is None:
            self._first_number = trial.number
        super().before_trial(study, trial)

    def _get_unvisited_grid_ids(self, study) -> list[int]:
        first = self._first_number if self._first_number is not None else float("inf")
        visited = set()
        for t in study._storage.get_all_trials(study._study_id, deepcopy=False):
            attrs = t.system_attrs
            if "grid_id" not in attrs or not self._same_search_space(attrs["search_space"]):
                continue
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING) or (
                    t.state == TrialState.FAIL and t.number >= first):  # fmt: skip
                visited.add(attrs["grid_id"])
        # (unlike Optuna's, no second pass returning running points: a batch asks for no more trials than
        # points are left, and a point started twice would be evaluated twice)
        return sorted(set(range(self._n_min_trials)) - visited)


__all__ = ["ResumableGridSampler"]
