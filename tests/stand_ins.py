"""Stand-ins that several test modules share (imported as ``stand_ins``: pytest puts this folder on ``sys.path``)."""

from __future__ import annotations


class Pinned:
    """A rate estimate that a load's own observations do not move (in place of a
    :class:`kvcodec.store.telemetry.RateEstimator`), so that a test fixes what the planner believes."""

    def __init__(self, estimate: float) -> None:
        self.estimate, self.samples = estimate, (estimate,)

    def observe(self, *_: float) -> None:
        pass
