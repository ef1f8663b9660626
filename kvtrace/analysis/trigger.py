"""A flight recorder's trigger: ``hit_rate < 0.2 for 60s`` over the live figures.

``parse_trigger`` reads ``NAME OP VALUE [for DURATION]``: NAME one of the live figures a
trigger may watch (``TRIGGER_FIGURES``), OP one of ``< <= > >=``. ``TriggerWatch`` fires once
the condition has held, figure update after figure update, for DURATION of the trace's own time
(the records' clock, so a trigger means the same live and on a replayed ring); a figure with no
value (no lookup in the window) breaks the hold. After firing it waits for the condition to
clear before it can fire again: one incident per collapse, not one a second.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Any

from kvtrace.errors import KvtraceError

# The live figures (``live.Figures``) a trigger may watch, with what each one is.
TRIGGER_FIGURES = {
    "hit_rate": "first-admission hit rate over the live window (0-1)",
    "checkpoint_share": "share of the pool held by transient Mamba checkpoints (0-1)",
    "pushouts_per_min": "cached blocks pushed out by mid-prompt checkpoints, per minute",
}
_OPERATORS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
_SYNTAX = re.compile(r"\s*([a-z_]+)\s*(<=|>=|<|>)\s*(\d+(?:\.\d*)?|\.\d+)\s*"
                     r"(?:for\s+(\d+(?:\.\d+)?)\s*([smh]?))?\s*")


class TriggerError(KvtraceError):
    default_hint = ("Write it as NAME OP VALUE [for DURATION], e.g. 'hit_rate < 0.2 for 60s'; "
                    "NAME: " + ", ".join(TRIGGER_FIGURES) + ".")


@dataclass(frozen=True)
class Trigger:
    figure: str
    op: str
    threshold: float
    hold_s: float
    text: str

    def holds(self, figures: Any) -> bool:
        value = getattr(figures, self.figure)
        return value is not None and _OPERATORS[self.op](value, self.threshold)


def parse_trigger(text: str) -> Trigger:
    match = _SYNTAX.fullmatch(text)
    if match is None:
        raise TriggerError(f"the trigger {text!r} is not NAME OP VALUE [for DURATION]")
    figure, op, value, hold, unit = match.groups()
    if figure not in TRIGGER_FIGURES:
        raise TriggerError(f"the trigger {text!r} watches {figure!r}, which is no live figure")
    hold_s = float(hold or 0) * {"": 1, "s": 1, "m": 60, "h": 3600}[unit or ""]
    return Trigger(figure, op, float(value), hold_s, " ".join(text.split()))


class TriggerWatch:
    """Feeds on successive figures (``update``); says when the trigger fires."""

    def __init__(self, trigger: Trigger) -> None:
        self.trigger = trigger
        self.held_since_s: float | None = None  # trace time the condition began to hold
        self.fired = False  # until the condition clears
        self.num_fired = 0

    def update(self, figures: Any) -> bool:
        """Whether the trigger fires with these figures (``figures.ts_s``: their trace time)."""
        if not self.trigger.holds(figures):
            self.held_since_s, self.fired = None, False
            return False
        if self.held_since_s is None:
            self.held_since_s = figures.ts_s
        if self.fired or figures.ts_s - self.held_since_s < self.trigger.hold_s:
            return False
        self.fired = True
        self.num_fired += 1
        return True
