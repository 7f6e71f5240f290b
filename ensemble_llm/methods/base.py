"""The interface every ensembling method implements.

A method gets the loaded members and a `Request` (each member's prompt ids, the token budget,
sampling settings) and is a generator of *final* text pieces: text it yields is never rolled
back, so the engine can stream it (after holding back a possible stop-string prefix). When the
engine closes the generator early (a stop string was found), the method just ends. The method
records its own figures in `Request.stats`, a dataclass of its own (`Method.stats_class`, a
`RunStats`: tokens out, tokens ensembled, skips by reason...);
forward passes and time per member are counted by the members themselves.

How the planned methods fit:
- single: one member decodes on its KV cache.
- unite / safe: the drafter's KVState advances token by token; verifiers `extend` their own
  canonical tokenization of the drafted text in one pass, read log-probs at their token
  boundaries (`encode_with_offsets`), and `crop` on rollback. Only text that no later rollback
  can touch is yielded.
- specfuse: each member drafts a segment on its own KVState; `score_inline` scores all segments
  in one pass per member; the winner is yielded as soon as it is chosen.
- smc: byte-level beams over each member's vocabulary trie (`members/bytelm.py`); `forward_rows` runs
  all particles' new token contexts in one batched forward per member; the prefix that all
  particles agree on is yielded.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Sequence

import torch

from ..errors import CapabilityError, ConfigError
from ..members import TokenLM
from ..members.protocol import BYTE_LM, FULL_ROWS, LOGITS
from ..stopping import StopPolicy

# weights="auto": a request where the calibrated prior AND the request's own evidence both give
# one member at least this weight runs that member alone (`evidence.solo_member`): the ensemble
# would follow it anyway, at the cost of every member. No pair weights reach it (the prior is
# 0.65 / 0.35 for raw prompts, 0.29 / 0.71 for chat); the trio's raw prior gives Qwen 1.00.
SOLO = 0.99


# weights="auto": how far a request's shown answers move its weights from the calibrated prior
# (evidence.py: log w = log prior + EVIDENCE x e; 0: the prior alone, 1: the tempered posterior).
# 0 by default: on the tune half (benchmarks/results/weights_tune) which member explains three
# shown answers better says little about which is right next (a mild reliability curve), and
# at 1 the weights route by it; the prior alone scored at least as well as every rate tried,
# drawn and fixed shots, and costs no scoring pass
EVIDENCE = 0.0


def check_evidence(value, owner: str) -> None:
    """`evidence`: a number in [0, 1] (see EVIDENCE)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ConfigError(
            f"{owner}.evidence must be a number in [0, 1] (0: the calibrated weights alone, 1: moved by the "
            f"shown answers' full evidence), got {value!r}"
        )


def check_solo(value, owner: str) -> None:
    """`solo`: None (always ensemble) or a weight in (0.5, 1] (see `evidence.solo_member`)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.5 < value <= 1.0):
        raise ConfigError(f"{owner}.solo must be None (always ensemble) or a number in (0.5, 1], got {value!r}")


@dataclass
class RunStats:
    """The figures of one method run; each method extends it with its own (`Method.stats_class`).

    tokens_out: tokens written, counted in the main member's tokenizer: the unit of
    `max_new_tokens` and of the reply's usage, whatever the method decodes in (keys, segments,
    bytes)."""

    tokens_out: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The figures as plain values (fields left at None are omitted), for `result.stats`."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def summarize(cls, runs: list["RunStats"]) -> dict[str, Any]:
        """Figures over many runs of one method (the bench's per-method columns)."""
        return {}


@dataclass
class Request:
    prompt_ids: list[list[int]]  # per member, its own prompt tokens (own template, own BOS)
    max_new_tokens: int  # budget, in the tokens of the method's main member
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    generator: torch.Generator | None = None
    stats: RunStats = field(default_factory=RunStats)  # the method replaces it with its own stats_class()
    finish_reason: str = "length"  # the method sets "stop" when it ends on EOS
    stops: StopPolicy = field(default_factory=StopPolicy)  # the engine cuts these too; methods end drafts on them
    weights: list[float] | None = None  # member weights for this request (resolved by the engine)
    prior: list[float] | None = None  # weights="auto": the calibrated weights before this request's evidence
    main: int = 0  # the main member (drafter / primary) for this request (resolved by the engine)
    aside: tuple[int, ...] = ()  # members that failed the shot exam (evidence.py): weight FLOOR
    guide: Any = None  # a constraints.Guide when the reply must match a grammar, else None
    trace: list[dict] | None = None  # when a list, the method appends where the ensemble decided
    # per member, the text that starts the next turn after its reply where a newline and a header
    # end it (a chat in a plain transcript: "\nUser:"); "" where its EOS ends it
    turn_ends: list[str] = field(default_factory=list)


class Method(abc.ABC):
    name: ClassVar[str]
    config_class: ClassVar[type | None] = None
    stats_class: ClassVar[type[RunStats]] = RunStats

    def __init__(self, members: list[TokenLM], config: Any = None) -> None:
        self.members = members
        self.config = config

    @classmethod
    def make_config(cls, config: Any) -> Any:
        """Validate `config` (None, a dict or the method's config dataclass)."""
        if cls.config_class is None:
            if config not in (None, {}):
                raise ConfigError(f"method {cls.name!r} takes no config, got {config!r}")
            return None
        if config is None:
            return cls.config_class()
        if isinstance(config, dict):
            names = {f.name for f in dataclasses.fields(cls.config_class)}
            unknown = sorted(set(config) - names)
            if unknown:
                raise ConfigError(f"{cls.config_class.__name__} has no field(s) {unknown}; valid: {sorted(names)}")
            return cls.config_class(**config)
        if not isinstance(config, cls.config_class):
            raise ConfigError(
                f"method {cls.name!r} needs a {cls.config_class.__name__} (or a dict), got {type(config).__name__}"
            )
        return config

    def for_kind(self, raw: bool) -> "Method":
        """The method that runs a request of this kind (raw prompt or chat): itself, except for
        `auto` (methods/auto.py), which runs each kind with a method of its own."""
        return self

    def check_members(self) -> None:  # noqa: B027 (an optional hook: most methods accept any members)
        """Raise ConfigError when the members do not suit this method. Only their number may be
        used: the engine calls it at construction with the unloaded sources, and again at load."""

    @classmethod  # noqa: B027 (an optional hook: most methods accept any sampling settings)
    def check_request(cls, config: Any, *, temperature: float, top_p: float) -> None:
        """Raise RequestError for sampling settings this method cannot honour. The engine calls it
        before queueing a request, so it fails before any work."""

    def needs(self) -> frozenset[str]:
        """What this method asks of every member beyond the state API (members/protocol.py's
        capabilities: whole rows, raw logits, the byte LM); a member without one is refused."""
        return frozenset()

    def kv_rows(self) -> int:
        """How many token sequences per member one request can hold KV for at once (kvbudget.py):
        1 (its state, batched with the others'); smc: a token tree of particles x beams."""
        return 1

    def main_member(self) -> int | None:
        """Index of the member whose tokens count the budget and the usage; None lets the engine
        pick the strongest member for each request (the largest calibrated weight)."""
        return 0

    def member_weights(self) -> list[float] | str | None:
        """The config's member weights: "auto", None (uniform) or a list."""
        return getattr(self.config, "weights", None)

    def evidence_rate(self) -> float:
        """How far the request's evidence moves its weights (config `evidence`, evidence.py)."""
        return float(getattr(self.config, "evidence", EVIDENCE))

    def exam_on(self) -> bool:
        """Whether a member that fails the prompt's shot exam steps aside (config `exam`, evidence.py)."""
        return bool(getattr(self.config, "exam", False))

    def solo_weight(self) -> float | None:
        """The weight at which one member runs alone (config `solo`; None: always ensemble)."""
        return getattr(self.config, "solo", None)

    def scoring_f(
        self, weights: Sequence[float], prior: Sequence[float], aside: Sequence[int]
    ) -> tuple[float, list[float]]:
        """How `Ensemble.score` combines the members' byte-level probabilities for this method
        (scoring.py): the power of the weighted mean and the member weights, given the request's
        weights, the prior and the members the shot exam stepped aside. By default the mixture
        of the request's weights (unite and safe average the members' probabilities)."""
        return 1.0, list(weights)

    @abc.abstractmethod
    def run(self, req: Request) -> Iterator[str]:
        """Yield final text pieces; set req.finish_reason and fill req.stats (a stats_class())."""


WHY = {
    FULL_ROWS: "every token's log-prob at a position (a constrained pick: tools, response_format)",
    LOGITS: "raw logits (SpecFuseConfig score='logit'; use score='logprob')",
    BYTE_LM: "every token's probability at each byte (smc, scoring)",
}


def check_capabilities(members: Sequence[Any], needs: frozenset[str], what: str) -> None:
    """CapabilityError naming the first member that lacks one of `needs`, where it runs and the fix."""
    for m in members:
        lack = sorted(set(needs) - m.capabilities)
        if lack:
            where = f"backend {m.backend!r}, {m.source}"
            raise CapabilityError(
                f"{what} needs {WHY.get(lack[0], lack[0])}, which member {m.name!r} ({where}) does not give: "
                "a server sends the top log-probs of a position, not the whole row (llama-server, vLLM and "
                "SGLang alike). Run that member in process (drop backend='server'), or use a method that "
                "needs less (single, specfuse, safe, unite)."
            )
