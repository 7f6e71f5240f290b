"""The process-wide table of shared engines (`Ensemble.shared`) and the holds facades keep on them.

One object owns the table and its lock, so an engine's close and a facade letting go agree on
who still uses an engine."""

from __future__ import annotations

import threading
import weakref
from typing import Any


class SharedEngines:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: dict[tuple, Any] = {}
        self._holds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> facades holding it

    @staticmethod
    def key(eng: Any) -> tuple:
        """Everything that makes two engines different (the constructor's arguments, resolved)."""
        return (
            tuple(s.ref for s in eng.sources),
            *map(repr, (eng.preambles, eng.options, eng.config, eng.member_resources)),
            *map(str, (eng.method_name, eng.devices, eng.dtypes, eng.cache_dir, eng.trust_remote_code)),
            *map(str, (eng.placement, eng.ray_address, eng.max_batch, eng.kv_budget.value)),
        )

    def get_or_add(self, eng: Any) -> Any:
        """The table's engine for `eng`'s arguments; `eng` itself when there is none yet."""
        with self._lock:
            return self._engines.setdefault(self.key(eng), eng)

    def drop(self, eng: Any) -> None:
        with self._lock:
            for k in [k for k, e in self._engines.items() if e is eng]:
                del self._engines[k]

    def hold(self, eng: Any) -> Any:
        with self._lock:
            self._holds[eng] = self._holds.get(eng, 0) + 1
        return eng

    def let_go(self, eng: Any) -> bool:
        """Ends one hold; True when it was the last."""
        with self._lock:
            left = max(0, self._holds.get(eng, 0) - 1)
            self._holds[eng] = left
            return left == 0


SHARED_ENGINES = SharedEngines()
