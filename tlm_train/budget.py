"""Budgets said aloud: a long phase estimates its time at the rate it measures, says it, and is refused above a limit.

A phase of ``total`` units (heal steps, sampled tokens, reconstruction epochs) reports its progress to a
:class:`Budget`. The first unit is not timed (start-up: allocations, kernel selection); once ``min_units`` more are
done and ``min_seconds`` have passed, the phase's whole time is estimated from that rate, once:

* above :data:`NOTE_SECONDS` it is said aloud through ``on_note`` ("heal: 488,281,250 steps, about 6,800 h at the
  rate of the first steps");
* above ``max_hours`` (``tlm-convert --max-hours``, default :data:`DEFAULT_MAX_HOURS`; ``tlm train --max-hours``,
  default :data:`TRAIN_MAX_HOURS`; 0: no limit) the phase is refused with ``limits.error`` naming the option to lower
  and the flag -- seconds into the phase, not after a day or a year.

Under torchrun every rank measures its own rate; ``agree`` (the ranks' maximum) makes them judge one estimate at the
same step, so all refuse or none does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from tlm_io.errors import ConversionError

DEFAULT_MAX_HOURS = 24.0  # a conversion (heal included) estimated longer is refused unless --max-hours allows it
TRAIN_MAX_HOURS = 720.0  # a training run estimated longer than 30 days is refused unless tlm train --max-hours allows it
NOTE_SECONDS = 60.0  # a phase estimated longer than this is said aloud


def human_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:,.0f} h" if seconds >= 36000 else f"{seconds / 3600:.1f} h"


class Phase(NamedTuple):
    """How a budget names its phase: what it is, its unit and what to lower ("heal", "steps of 2,048 tokens",
    "lower --heal-tokens")."""

    what: str
    unit: str
    fix: str


TRAINING = Phase("training", "steps", "lower train.max_steps")  # tlm train's own wording


@dataclass
class Limits:
    """What every long phase of one run shares: the time limit (hours; None or 0: none), where notes go, and the
    error a refusal raises."""

    max_hours: float | None = DEFAULT_MAX_HOURS
    on_note: Callable[[str], None] | None = None
    flag: str = "--max-hours"
    error: type[Exception] = ConversionError

    def budget(self, what: str, total: int, unit: str, fix: str, **kwargs) -> "Budget":
        return Budget(what, total, unit, fix, self, **kwargs)


class Budget:
    """The time budget of one phase of ``total`` ``unit`` (see the module doc). ``fix``: what to lower, e.g.
    "lower --heal-tokens"."""

    def __init__(self, what: str, total: int, unit: str, fix: str, limits: Limits | None = None,
                 min_units: int = 2, min_seconds: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 agree: Callable[[float], float] | None = None):
        self.what, self.total, self.unit, self.fix = what, int(total), unit, fix
        self.limits = limits or Limits()
        self.min_units, self.min_seconds, self.clock, self.agree = min_units, min_seconds, clock, agree
        self.base: tuple[int, float] | None = None  # (units done, time) when timing started
        self.done = 0
        self.estimate: float | None = None  # seconds of the whole phase, once measured

    def tick(self, units: int = 1) -> None:
        """``units`` more done."""
        self.update(self.done + units)

    def update(self, done: int) -> None:
        """``done`` units of ``total`` are done (see the module doc)."""
        self.done = done
        if self.estimate is not None or done >= self.total:
            return
        now = self.clock()
        if self.base is None:
            self.base = (done, now)
            return
        units, seconds = done - self.base[0], now - self.base[1]
        if units < self.min_units or seconds < self.min_seconds:
            return
        self.estimate = seconds / units * self.total
        if self.agree is not None:
            self.estimate = self.agree(self.estimate)
        self._judge(units)

    def _judge(self, measured: int) -> None:
        said = (f"{self.what}: {self.total:,} {self.unit}, about {human_duration(self.estimate)} at the rate of its "
                f"first {measured + self.base[0]:,} {self.unit.split()[0]}")
        limit = self.limits.max_hours
        if limit and self.estimate > limit * 3600:
            raise self.limits.error(f"{said}, above the {self.limits.flag} {limit:g} limit; {self.fix}, or pass "
                                  f"{self.limits.flag} 0 (no limit) or a larger value")
        if self.estimate > NOTE_SECONDS and self.limits.on_note is not None:
            self.limits.on_note(said)


__all__ = ["Budget", "Limits", "Phase", "TRAINING", "DEFAULT_MAX_HOURS", "TRAIN_MAX_HOURS", "NOTE_SECONDS",
           "human_duration"]
