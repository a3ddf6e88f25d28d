"""Load shapes: when each request is sent (open loop) or how many users send them (closed loop).

Open loop: each request leaves at its scheduled time whatever the server does (arrivals do not wait
for answers), possibly held back by a cap on requests in flight. Schedules:

- ``trace``: the trace's own arrival times, first arrival at 0, multiplied by ``time_scale``
  (0.5 = twice as fast);
- ``poisson``: exponential gaps at ``rate`` requests/s (seeded);
- ``constant``: one request every 1/``rate`` s.

Closed loop (``closed``): ``users`` concurrent users; each sends its next request when its previous
one ended, after ``think_s`` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from servelab.common.errors import ServelabError

SHAPES = ("trace", "poisson", "constant", "closed")


@dataclass(frozen=True, slots=True)
class LoadConfig:
    shape: str = "trace"
    time_scale: float = 1.0  # trace shape: multiplies the trace's arrival times
    rate: float | None = None  # poisson / constant: requests per second
    users: int | None = None  # closed: concurrent users
    think_s: float = 0.0  # closed: pause between a user's requests
    max_in_flight: int | None = None  # open loop: most requests outstanding at once (None: no cap)
    duration_s: float | None = None  # stop sending after this; requests still in flight are cancelled
    num_requests: int | None = None  # send only the first N trace requests
    warmup: int = 0  # requests sent (and awaited) before the measured run, left out of the results
    seed: int = 0

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ServelabError(f"load shape must be one of {', '.join(SHAPES)} (got {self.shape!r})")
        if self.shape in ("poisson", "constant") and not (self.rate and self.rate > 0):
            raise ServelabError(f"the {self.shape} load shape needs --rate > 0")
        if self.shape == "closed" and not (self.users and self.users >= 1):
            raise ServelabError("the closed load shape needs --users >= 1")
        if self.shape != "closed" and self.users is not None:
            raise ServelabError("--users goes with --shape closed")
        if self.shape == "closed" and self.max_in_flight is not None:
            raise ServelabError("--max-in-flight goes with an open-loop shape (a closed loop has --users in flight)")
        if not self.time_scale > 0:
            raise ServelabError("--time-scale must be > 0")
        if self.duration_s is not None and not self.duration_s > 0:  # (0 would send nothing)
            raise ServelabError("--duration must be > 0")
        if self.think_s is not None and not self.think_s >= 0:
            raise ServelabError("--think must be >= 0")
        for name in ("max_in_flight", "num_requests"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ServelabError(f"--{name.replace('_', '-')} must be >= 1")
        if self.warmup < 0:
            raise ServelabError("--warmup must be >= 0")

    @property
    def open_loop(self) -> bool:
        return self.shape != "closed"


def schedule(load: LoadConfig, arrivals: np.ndarray) -> np.ndarray:
    """Send times (s, from 0) of an open-loop run's requests, in request order."""
    n = len(arrivals)
    if n == 0:
        return np.zeros(0)
    if load.shape == "trace":
        return (np.asarray(arrivals, dtype=np.float64) - float(arrivals[0])) * load.time_scale
    if load.shape == "constant":
        return np.arange(n, dtype=np.float64) / load.rate
    if load.shape == "poisson":
        gaps = np.random.default_rng(load.seed).exponential(1.0 / load.rate, size=n)
        gaps[0] = 0.0
        return np.cumsum(gaps)
    raise ServelabError(f"the {load.shape} load shape has no schedule")
