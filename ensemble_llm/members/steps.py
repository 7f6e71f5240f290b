"""The calls a request makes of a member, typed, and the knobs of the steps that batch them.

A call is what one request asks of one member's forward: a prompt's prefill (`Prefill`, scored
at some positions for the per-request weights), tokens appended to a state (`Extend`), specfuse's
candidates scored side by side after a state (`Score`), smc's token trees (`Tree`). The step
scheduler (scheduler.py) gathers the waiting calls of all running requests into steps; each
member's executor runs a step's calls (`Executor`): transformers row groups (backends/transformers/rowgroups.py),
llama.cpp sequences (backends/llama_cpp/member.py), a Ray actor (ray/member.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, Sequence

from .context import Tally


@dataclass(frozen=True)
class BatchingConfig:
    """How the engine's steps run (one per engine; benches and tests pass their own)."""

    # how long waiting requests wait for one that is still computing before stepping without it
    gather_s: float = 0.02
    # steps a call may be passed over for a larger group of another member (StepScheduler.take):
    # specfuse's requests spend a whole segment on one member and gain from deferring; unite and
    # safe do not care (benchmarks/batching_throughput.py)
    max_defer: int = 10
    # transformers steps: the output layer only at the columns a call reads (False: at the step's
    # longest read in every row, as `logits_to_keep` gives it)
    sparse_head: bool = True
    # transformers steps: hole columns a step may compute before it is split (one-token calls beside
    # longer ones run apart; a forward covers only its calls' rows when the others would pay this many)
    split_columns: int = 16
    # transformers steps: a group is rebuilt once its width passes twice its longest row plus this
    slack: int = 64


@dataclass(eq=False)
class StepCall:
    """One request's call of one member (see the module); the step sets `result` or `error`."""

    kind: ClassVar[str] = ""
    member: Any
    state: Any
    tally: Tally | None = None
    guard: Any = None  # the request's deadline and cancellation check, run while the call waits
    done: bool = False
    result: Any = None
    error: BaseException | None = None
    since: float = field(default_factory=time.monotonic)
    deferred: int = 0  # steps that passed this call over (StepScheduler.take)

    @property
    def new(self) -> list[int]:
        """The tokens this call appends as new positions of its state."""
        return []


@dataclass(eq=False)
class Prefill(StepCall):
    """A prompt into an empty state; with `positions`, scored too (`score_prompt`: log p(ids[p] | ids[:p]))."""

    kind: ClassVar[str] = "prefill"
    ids: list[int] = field(default_factory=list)
    positions: list[int] | None = None


@dataclass(eq=False)
class Extend(StepCall):
    """Tokens appended to a state: log-probs of every new position, or of the last only."""

    kind: ClassVar[str] = "step"
    tokens: list[int] = field(default_factory=list)
    last_only: bool = False

    @property
    def new(self) -> list[int]:
        return self.tokens


@dataclass(eq=False)
class Score(StepCall):
    """specfuse's candidates after a state, each seeing the state and itself only; their positions
    stay until keep_candidate / drop_candidates. `raw_logits` and `keep`: score_inline's, for an
    executor that scores and keeps them itself (a Ray actor's member)."""

    kind: ClassVar[str] = "step"
    cands: list[list[int]] = field(default_factory=list)
    raw_logits: bool = False
    keep: bool = False

    @property
    def new(self) -> list[int]:
        return [t for c in self.cands for t in c]

    @property
    def segments(self) -> list[list[int]]:
        return self.cands


@dataclass(eq=False)
class Tree(StepCall):
    """smc's new token contexts: (prefix_kv, paths, tokens) for transformers, the byte LM's own
    request for llama.cpp and Ray members."""

    kind: ClassVar[str] = "tree"
    tree: Any = None


def segments(call: StepCall) -> list[list[int]]:
    """Runs of new tokens that see each other (causally); a candidate does not see the others."""
    return call.segments if isinstance(call, Score) else [call.new]


class Executor(Protocol):
    """Runs a member's calls (see the module). `apart`: the member computes outside this process
    (a Ray actor): its steps never wait for another member's."""

    apart: bool

    def group(self, call: StepCall) -> tuple:
        """Calls with the same key run in one step of this executor."""
        ...

    def batchable(self, call: StepCall) -> bool:
        """Whether the call may wait for a step (else it runs alone at once)."""
        ...

    def run(self, calls: Sequence[StepCall], config: BatchingConfig) -> None:
        """Run the calls of one group in one step (as few forwards as the backend allows)."""
        ...

    def run_alone(self, call: StepCall, config: BatchingConfig) -> Any:
        """Run one call in a forward of its own and return its result."""
        ...

    def recover(self, call: StepCall) -> None:
        """After a step that failed: leave the call's state as it was before the call."""
        ...
