"""Multi-token stop strings on text: cut before the stop string, never emit any part of it.

Methods produce text (not one tokenizer's ids), so stop strings are matched on text: each delta is
released only up to the point where no stop string could still begin.
"""

from __future__ import annotations

from typing import Any

from .errors import RequestError


def stop_list(*stops: Any) -> list[str]:
    """Stop settings (None, one string, or a list of strings each) joined into one list. A string
    is ONE stop string, never its characters. Anything else is a RequestError naming it."""
    out: list[str] = []
    for stop in stops:
        if stop is None:
            continue
        if isinstance(stop, str):
            out.append(stop)
        elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            out.extend(stop)
        else:
            raise RequestError(f"stop must be a string or a list of strings, got {type(stop).__name__} {stop!r}")
    return out


class StopMatcher:
    def __init__(self, stops: list[str] | tuple[str, ...] = ()) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self.pending = ""  # text received but not yet released
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Take new text; return the part that is safe to emit. Sets `stopped` on a match."""
        if self.stopped:
            return ""
        self.pending += delta
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.pending, self.stopped = self.pending[:cut], "", True
            return out
        hold = self._held_suffix()
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold :]
        return out

    def flush(self) -> str:
        """End of generation: whatever is held back is not a stop string after all."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out

    def _held_suffix(self) -> int:
        """Length of the longest suffix of pending that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(s[:k]):
                    best = k
                    break
        return best
