"""The process-wide table of shared engines (`Ensemble.shared`) and the holds facades keep on them.

One object owns the table and its lock, so an engine's close and a facade letting go agree on
who still uses an engine. Both facades' `model` field is checked here too, once for both."""

from __future__ import annotations

import threading
import weakref
from typing import Any

# the engine constructor's keyword options after members / method / config; the facades mirror
# them as fields (here, not in engine.py: a facade imports this without loading the engine)
ENGINE_OPTIONS = (
    "device",
    "dtype",
    "cache_dir",
    "trust_remote_code",
    "progress",
    "placement",
    "ray_address",
    "member_resources",
    "max_batch",
    "kv_budget",
)


class SharedEngines:
    def __init__(self) -> None:
        # reentrant: a facade's finalizer (`_let_go`) runs whenever the garbage collector does, which
        # can be inside this table's own lock in the same thread (CI hung there once, in get_or_add)
        self._lock = threading.RLock()
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

    def hold_for(self, owner: object, eng: Any) -> weakref.finalize:
        """`owner` (a facade) holds `eng` until it is collected or the returned finalizer is called;
        the last holder to go closes the engine (frees its members)."""
        with self._lock:
            self._holds[eng] = self._holds.get(eng, 0) + 1
        release = weakref.finalize(owner, self._let_go, eng)
        release.atexit = False  # at exit the process frees the members anyway
        return release

    def _let_go(self, eng: Any) -> None:
        with self._lock:
            left = max(0, self._holds.get(eng, 0) - 1)
            self._holds[eng] = left
        if left == 0:
            eng.close()


def check_model_id(given: str | None, model_id: str) -> str:
    """What a facade's `model` field holds in process: the engine's id; another value is an error."""
    if given is not None and given != model_id:
        raise ValueError(
            f"EnsembleLLM(model={given!r}) does not choose models in process: members= and method= do "
            f"(these give {model_id!r}). Drop model=, or pass base_url= to ask a served ensemble for {given!r}."
        )
    return model_id


SHARED_ENGINES = SharedEngines()
