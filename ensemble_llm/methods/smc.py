"""`smc`: byte-level f-ensembles sampled by sequential Monte Carlo (Chan et al., arXiv 2603.05432).

Target: pi_f(x) proportional to f(P_1(x), ..., P_K(x)) over complete strings x, where P_k is member
k's byte-level probability (marginalised over its tokenizations, `bytelm.py`) and f a weighted
power mean: product (tau -> 0), mixture (tau = 1), harmonic (tau = -1), min, max, or any tau.

Particles grow byte by byte. With psi(x) = f(P_1(x), ..., P_K(x)) on prefixes, a particle at x
draws b from q(b | x) proportional to psi(xb) over 256 bytes + EOS, and its log weight grows by
log sum_b psi(xb) - log psi(x); the product of those ratios times q is psi(x EOS), so the weights
make the particles a sample of pi_f. When the effective sample size falls below
ess_threshold * N the particles are resampled (multinomial) and all get the mean weight.

Efficiency: the prompt is prefilled once per member at token level; every byte step makes at
most one batched forward per member for all new token contexts of all particles and beam
hypotheses; particles with a common history share contexts (and their KV) in a tree.
Streaming: the bytes all live particles agree on are final and are yielded as they grow.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from ..errors import ConfigError, GenerationError, RequestError
from ..evidence import FLOOR
from ..guide import CLOSE_MARGIN
from ..members.bytelm import EOS
from ..members.protocol import BYTE_LM
from .base import EVIDENCE, SOLO, Method, Request, RunStats, check_evidence, check_solo
from .text import Utf8Releaser

NEG_INF = -math.inf
# weights="auto": the product keeps equal exponents unless the calibrated prior gives one member at
# least this (then it follows the request's weights, so weak members cannot outvote a far stronger
# one: the trio's chat prior gives Qwen2.5-Coder 0.97). The pair's priors are 0.65 and 0.71; any
# value between 0.71 and 0.97 gives the same results on every run in README.
DOMINANT = 0.9
F_NAMES = {"product": 0.0, "mixture": 1.0, "harmonic": -1.0, "min": -math.inf, "max": math.inf}


@dataclass
class SmcConfig:
    f: str = "product"  # product | mixture | harmonic | min | max | power (then tau is required)
    tau: float | None = None  # the power of the mean when f == "power"
    n_particles: int = 8
    ess_threshold: float = 0.5  # resample when ESS < ess_threshold * n_particles
    beam_width: int = 5  # tokenization hypotheses per member and particle
    # also drop tokenization hypotheses below this fraction of the best one: each carries under
    # 0.1% of the prefix mass, and dropping them halves the batched rows (0 = beam width only)
    prune_threshold: float = 1e-3
    max_bytes: int | None = None  # byte budget per particle (the token budget applies as well)
    # member weights of the mean: "auto" (the request's weights, evidence.py; the product's exponents
    # stay equal while no member holds DOMINANT of the prior, see `run`), None (equal), a list
    weights: list[float] | str | None = "auto"
    return_particles: bool = False  # put the weighted particle set in stats["particles"]
    # temperature 0: "beam" seeks the f-ensemble's mode (byte-level beam search over psi, n_particles
    # wide); "sample" draws one SMC sample of the untempered ensemble with a fixed seed
    greedy: str = "beam"
    solo: float | None = SOLO  # weights="auto": run a member alone where it holds this weight (evidence.py)
    evidence: float = EVIDENCE  # weights="auto": how far the shown answers move the weights (evidence.py)
    exam: bool = True  # weights="auto": a member that writes none of the shown answers steps aside (evidence.py)

    def __post_init__(self) -> None:
        if self.f == "power":
            if not isinstance(self.tau, (int, float)) or isinstance(self.tau, bool) or math.isnan(self.tau):
                raise ConfigError("SmcConfig(f='power') needs a number tau (0 is the product, 1 the mixture)")
        elif self.f not in F_NAMES:
            raise ConfigError(f"SmcConfig.f must be one of {sorted(F_NAMES) + ['power']}, got {self.f!r}")
        elif self.tau is not None:
            raise ConfigError(
                f"SmcConfig.tau is only used with f='power' (f={self.f!r} fixes it); set f='power' or drop tau"
            )
        if not isinstance(self.n_particles, int) or self.n_particles < 1:
            raise ConfigError(f"SmcConfig.n_particles must be an integer >= 1, got {self.n_particles!r}")
        for name in ("ess_threshold", "prune_threshold"):
            if not isinstance(getattr(self, name), (int, float)) or isinstance(getattr(self, name), bool):
                raise ConfigError(f"SmcConfig.{name} must be a number, got {getattr(self, name)!r}")
        if not 0.0 <= self.ess_threshold <= 1.0:
            raise ConfigError(f"SmcConfig.ess_threshold must be in [0, 1], got {self.ess_threshold!r}")
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ConfigError(f"SmcConfig.beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not 0.0 <= self.prune_threshold < 1.0:
            raise ConfigError(f"SmcConfig.prune_threshold must be in [0, 1), got {self.prune_threshold!r}")
        check_solo(self.solo, "SmcConfig")
        check_evidence(self.evidence, "SmcConfig")
        if not isinstance(self.exam, bool):
            raise ConfigError(f"SmcConfig.exam must be True or False, got {self.exam!r}")
        if self.greedy not in ("beam", "sample"):
            raise ConfigError(f"SmcConfig.greedy must be 'beam' or 'sample', got {self.greedy!r}")
        if self.max_bytes is not None and (not isinstance(self.max_bytes, int) or self.max_bytes < 1):
            raise ConfigError(f"SmcConfig.max_bytes must be None or an integer >= 1, got {self.max_bytes!r}")
        if (
            self.weights is not None
            and self.weights != "auto"
            and (
                not isinstance(self.weights, (list, tuple))
                or not self.weights
                or any(not isinstance(w, (int, float)) or not 0 < w < math.inf for w in self.weights)
            )
        ):
            raise ConfigError(
                f"SmcConfig.weights must be positive finite numbers, one per member; got {self.weights!r}"
            )

    @property
    def power(self) -> float:
        return float(self.tau) if self.f == "power" else F_NAMES[self.f]


def f_ensemble(logp: np.ndarray, tau: float, weights: np.ndarray, axis: int = 0) -> np.ndarray:
    """Log of the weighted power mean over `axis` of probabilities given as logs.
    tau = 0: weighted geometric mean (product of experts); +-inf: max / min (weights unused)."""
    logp = np.moveaxis(np.asarray(logp, dtype=np.float64), axis, 0)
    w = np.asarray(weights, dtype=np.float64).reshape((-1,) + (1,) * (logp.ndim - 1))
    if tau == math.inf:
        return logp.max(axis=0)
    if tau == -math.inf:
        return logp.min(axis=0)
    if tau == 0.0:
        with np.errstate(invalid="ignore"):
            out = (w * logp).sum(axis=0)
        return np.where(np.isneginf(logp).any(axis=0), NEG_INF, out)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        lse = np.logaddexp.reduce(tau * logp + np.log(w), axis=0)
    return lse / tau


@dataclass
class Particle:
    states: list[Any]  # one byte-LM state per member
    lp: np.ndarray  # [K] log P_k(text)
    text: bytes = b""
    logw: float = 0.0
    done: str | None = None  # "stop" (EOS or a stop string), "length", or "dead" (psi = 0)

    def copy(self) -> "Particle":
        return Particle(list(self.states), self.lp.copy(), self.text, self.logw, self.done)


@dataclass
class SmcRun:
    """State and figures of one SMC run (see `smc_sample`)."""

    particles: list[Particle]
    ess: list[float] = field(default_factory=list)
    resamplings: int = 0
    steps: int = 0

    @property
    def log_z(self) -> float:
        """Estimate of log sum_x psi(x) over the strings the particles ended on."""
        w = np.array([p.logw for p in self.particles])
        return float(np.logaddexp.reduce(w) - math.log(len(w)))

    def normalised(self) -> np.ndarray:
        w = np.array([p.logw for p in self.particles])
        total = np.logaddexp.reduce(w)
        if not np.isfinite(total):
            return np.full(len(w), 1.0 / len(w))
        return np.exp(w - total)

    def posterior(self) -> dict[bytes, float]:
        """Normalised weight of every distinct particle text (duplicates merged)."""
        out: dict[bytes, float] = {}
        for p, w in zip(self.particles, self.normalised()):
            out[p.text] = out.get(p.text, 0.0) + float(w)
        return out


def _extensions(
    lms: Sequence[Any],
    rows: Sequence[Particle],
    tau: float,
    w: np.ndarray,
    allowed: Callable[[bytes], np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every row x and slot b (256 bytes + EOS): log P_k(x) [n, K], log P_k(x b) [n, K, 257]
    and log psi(x b) [n, 257]; one batched next-byte call per member. With `allowed` (a grammar's
    next-byte mask after a text), psi(x b) is 0 for every byte the grammar forbids: the target is
    then pi_f restricted to the grammar's strings, and SMC's weights (the allowed mass) and the
    beam's scores follow that target exactly."""
    # every member is asked before any answer is read: members in Ray actors compute in parallel
    # every member is asked before any answer is read: byte LMs in Ray actors answer in parallel
    asks = [lm.next_logprobs_async([p.states[k] for p in rows]) for k, lm in enumerate(lms)]
    logq = np.stack([a.get() for a in asks], axis=1)
    lp = np.stack([p.lp for p in rows])
    joint = lp[:, :, None] + logq
    psi_next = f_ensemble(joint, tau, w, axis=1)
    if allowed is not None:
        mask = np.stack([allowed(p.text) for p in rows])
        psi_next = np.where(mask, psi_next, NEG_INF)
    return lp, joint, psi_next


def smc_sample(
    lms: Sequence[Any],
    starts: Sequence[Any],
    *,
    tau: float,
    weights: Sequence[float],
    n_particles: int,
    ess_threshold: float,
    generator: torch.Generator | None,
    finished: Callable[[Particle], str | None],
    run: SmcRun | None = None,
    allowed: Callable[[bytes], np.ndarray] | None = None,
) -> Iterator[SmcRun]:
    """SMC over byte LMs (objects with `next_logprobs(states) -> [n, 257]` log-probs and
    `advance(state, byte) -> state`). Yields the run after every byte step (after resampling);
    `finished(particle)` names why a particle stops after a byte (a stop string, the budget)."""
    K = len(lms)
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    run = run or SmcRun([Particle(list(starts), np.zeros(K)) for _ in range(n_particles)])
    while True:
        alive = [p for p in run.particles if p.done is None]
        if not alive:
            return
        run.steps += 1
        uniq: dict[tuple, int] = {}  # identical particles (after resampling) share one computation
        rows, row_of = [], []
        for p in alive:
            key = tuple(id(s) for s in p.states)
            if key not in uniq:
                uniq[key] = len(rows)
                rows.append(p)
            row_of.append(uniq[key])
        lp, joint, psi_next = _extensions(lms, rows, tau, w, allowed)
        psi = f_ensemble(lp, tau, w, axis=1)  # [n]
        total = np.logaddexp.reduce(psi_next, axis=1)  # [n]
        probs = np.exp(psi_next - np.where(np.isfinite(total), total, 0.0)[:, None])
        probs = np.where(np.isfinite(total)[:, None], probs, 0.0)
        for p, r in zip(alive, row_of):
            if not np.isfinite(total[r]):
                p.logw, p.done = NEG_INF, "dead"
                continue
            b = int(torch.multinomial(torch.from_numpy(probs[r]), 1, generator=generator))
            p.logw += float(total[r] - psi[r])
            p.lp = joint[r, :, b].copy()
            if b == EOS:
                p.done = "stop"
                continue
            p.text += bytes([b])
            p.states = [lm.advance(s, b) for lm, s in zip(lms, p.states)]
            p.done = finished(p)
        _resample(run, ess_threshold, generator)
        yield run


def _resample(run: SmcRun, ess_threshold: float, generator: torch.Generator | None) -> None:
    """Record the effective sample size; below `ess_threshold` x n (and while a particle is
    still going), resample multinomially, every particle at the mean weight."""
    wn = run.normalised()
    ess = float(1.0 / np.sum(wn**2))
    run.ess.append(ess)
    if ess < ess_threshold * len(run.particles) and any(p.done is None for p in run.particles):
        idx = torch.multinomial(
            torch.from_numpy(wn), len(run.particles), replacement=True, generator=generator
        ).tolist()
        mean = run.log_z  # the mean weight: resampling keeps the estimate of log Z
        run.particles = [run.particles[i].copy() for i in idx]
        for p in run.particles:
            p.logw = mean
        run.resamplings += 1


@dataclass
class BeamRun:
    """State of a byte-level beam search over psi (see `beam_search`)."""

    live: list[Particle]
    done: list[Particle] = field(default_factory=list)  # finished strings; logw = log psi(x END)
    steps: int = 0

    def best(self) -> Particle | None:
        return max(self.done, key=lambda p: p.logw, default=None)


def beam_search(
    lms: Sequence[Any],
    starts: Sequence[Any],
    *,
    tau: float,
    weights: Sequence[float],
    width: int,
    finished: Callable[[Particle], str | None],
    allowed: Callable[[bytes], np.ndarray] | None = None,
) -> Iterator[BeamRun]:
    """Deterministic search for the mode of pi_f: beam search over byte prefixes scored by
    log psi(x), `width` prefixes kept per byte step, each step one batched forward per member.

    Every P_k(x) is a prefix probability, so P_k(xb) <= P_k(x), and a weighted power mean is
    increasing in each argument: psi never grows along an extension. A finished string (EOS, a
    stop string, the budget) scoring at least every live prefix therefore beats every string the
    beam could still reach, and the search stops there; with a beam wide enough to keep every
    prefix it returns the exact argmax of psi. Yields after every byte step."""
    K = len(lms)
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    run = BeamRun([Particle(list(starts), np.zeros(K))])
    while run.live:
        best = run.best()
        if best is not None and best.logw >= max(p.logw for p in run.live):
            return
        run.steps += 1
        _, joint, psi_next = _extensions(lms, run.live, tau, w, allowed)
        cands = []
        for r in range(len(run.live)):
            for b in np.flatnonzero(np.isfinite(psi_next[r])):
                cands.append((float(psi_next[r, b]), r, int(b)))
        cands.sort(key=lambda c: -c[0])
        live = []
        for score, r, b in cands:
            parent = run.live[r]
            if b == EOS:
                run.done.append(Particle(parent.states, joint[r, :, b].copy(), parent.text, score, "stop"))
                continue
            if len(live) >= width:
                continue
            child = Particle(parent.states, joint[r, :, b].copy(), parent.text + bytes([b]), score)
            child.states = [lm.advance(st, b) for lm, st in zip(lms, parent.states)]
            child.done = finished(child)
            (run.done if child.done else live).append(child)
        run.live = live
        yield run


@dataclass
class SmcStats(RunStats):
    bytes_out: int = 0
    search: str = "smc"  # "smc" (SMC sampling) or "beam" (the mode at temperature 0)
    heals: int = 0  # byte-LM beams revived by committing partial bytes as a token
    f: str = ""  # the f-ensemble, e.g. "product" or "power(2)"
    n_particles: int = 0
    # SMC sampling
    smc_steps: int | None = None
    resamplings: int | None = None
    ess: list[float] | None = None  # effective sample size after every byte step
    log_z: float | None = None
    distinct_texts: int | None = None
    best_weight: float | None = None
    # beam search
    beam_steps: int | None = None
    finished_candidates: int | None = None
    best_log_psi: float | None = None
    particles: list[dict] | None = None  # with return_particles

    @classmethod
    def summarize(cls, runs: list[RunStats]) -> dict[str, Any]:
        ess = [e for r in runs for e in (r.ess or [])]
        steps = sum((r.smc_steps or 0) + (r.beam_steps or 0) for r in runs)
        return {
            "ess_mean": sum(ess) / len(ess) if ess else None,
            "resamplings_per_step": sum(r.resamplings or 0 for r in runs) / max(1, steps),
            "bytes_out": sum(r.bytes_out for r in runs),
            "byte_steps": steps,
            "search": runs[0].search if runs else None,
        }


class Smc(Method):
    name = "smc"
    config_class = SmcConfig
    stats_class = SmcStats

    def main_member(self) -> int | None:
        return None  # the strongest member counts the token budget

    def kv_rows(self) -> int:
        return self.config.n_particles * self.config.beam_width

    def needs(self) -> frozenset[str]:
        return frozenset({BYTE_LM})

    def check_members(self) -> None:
        if len(self.members) < 2:
            raise ConfigError(
                f"method 'smc' ensembles K >= 2 members, got {len(self.members)}; add a member or use method='single'"
            )
        if isinstance(self.config.weights, (list, tuple)) and len(self.config.weights) != len(self.members):
            raise ConfigError(
                f"SmcConfig.weights has {len(self.config.weights)} entries for "
                f"{len(self.members)} members; give one weight per member"
            )

    @classmethod
    def check_request(cls, config: Any, *, temperature: float, top_p: float) -> None:
        if top_p < 1.0:
            raise RequestError(
                "method 'smc' samples the f-ensemble of the full distributions; top_p "
                f"truncation is not supported (got top_p={top_p}); leave top_p at 1"
            )

    def exponents(
        self, weights: Sequence[float] | None, prior: Sequence[float] | None, aside: Sequence[int]
    ) -> list[float] | None:
        """The member weights of the mean. With weights="auto", the product's exponents are equal
        unless the prior gives one member DOMINANT: the request's weights (a posterior over which
        member knows the task, evidence.py) chose the main member and whether one runs alone
        (`solo`), but as exponents they made the product follow one member (suite, 301 examples:
        96-98 correct against 103 with equal exponents; README). A member the shot exam stepped
        aside keeps its floor weight."""
        cfg = self.config
        if cfg.weights == "auto" and cfg.power == 0.0 and max(prior or weights or [1.0]) < DOMINANT:
            live = len(self.members) - len(aside)
            return [FLOOR if k in aside else 1.0 / live for k in range(len(self.members))]
        return None if weights is None else list(weights)

    def scoring_f(self, weights, prior, aside) -> tuple[float, list[float]]:
        return self.config.power, self.exponents(weights, prior, aside) or [1.0] * len(self.members)

    def run(self, req: Request) -> Iterator[str]:
        cfg = self.config
        self.check_request(cfg, temperature=req.temperature, top_p=req.top_p)
        req.weights = self.exponents(req.weights, req.prior, req.aside)
        # temperature 0 (greedy elsewhere): the mode of the untempered ensemble by beam search, or
        # (greedy="sample") one SMC sample with a fixed seed; temperature > 0 tempers every member.
        temperature = req.temperature if req.temperature > 0 else 1.0
        search = req.temperature == 0 and cfg.greedy == "beam"
        lms = [
            m.byte_lm(cfg.beam_width, cfg.prune_threshold, temperature, keep_fresh=req.guide is not None)
            for m in self.members
        ]
        ending = _Ending(req, cfg.max_bytes or 16 * req.max_new_tokens)
        emit = Utf8Releaser()
        sent, sent_bytes = 0, b""
        run = None
        # a stop string can only be cut from the end of a particle's text: hold that many bytes back
        hold = req.stops.hold
        for run in self._steps(req, lms, search, ending):
            if search:  # final: a prefix of every live beam and of the best finished string
                best = run.best()
                live = run.live + ([best] if best is not None else [])
                unfinished = bool(run.live)
            else:
                live = [p for p in run.particles if p.logw > NEG_INF] or run.particles
                unfinished = any(p.done is None for p in live)
            agreed = os.path.commonprefix([p.text for p in live])
            upto = len(agreed) - hold if unfinished else len(agreed)
            piece = ""
            if upto > sent:
                piece = emit.take(agreed[:upto])
                sent_bytes, sent = agreed[:upto], upto
            # yield after every byte step, even nothing: the engine checks cancel and timeout there
            yield piece
            alive = run.live if search else [p for p in run.particles if p.done is None]
            for k, lm in enumerate(lms):
                lm.compact([p.states[k] for p in alive])
        best, stats = self._best(run, search, sent_bytes)
        tail = emit.take(best.text, final=True)  # undecodable last bytes are dropped, never shown as U+FFFD
        if tail:
            yield tail
        req.finish_reason = "stop" if best.done == "stop" else "length"
        if req.guide:
            req.guide.closed_early = best.text in ending.closed and best.done != "stop"
        self._report(req, run, best, search, sum(lm.heals for lm in lms), stats)

    def _steps(self, req: Request, lms: list, search: bool, ending: "_Ending") -> Iterator:
        """The byte steps of the search (temperature 0, greedy="beam") or of the SMC sampler."""
        cfg = self.config
        starts = [lm.start(ids) for lm, ids in zip(lms, req.prompt_ids)]
        weights = req.weights or [1.0] * len(lms)
        allowed = req.guide.byte_mask if req.guide else None
        if search:
            return beam_search(
                lms, starts, tau=cfg.power, weights=weights, width=cfg.n_particles, finished=ending, allowed=allowed
            )
        return smc_sample(
            lms,
            starts,
            tau=cfg.power,
            weights=weights,
            n_particles=cfg.n_particles,
            ess_threshold=cfg.ess_threshold,
            generator=req.generator if req.temperature > 0 else torch.Generator().manual_seed(0),
            finished=ending,
            allowed=allowed,
        )

    def _best(self, run, search: bool, sent_bytes: bytes) -> tuple[Particle, dict[str, Any]]:
        """The answer and the search's own figures, once the steps are over."""
        if search:
            best = run.best() if run is not None else None
            if best is None and run.live:  # the budget ended every beam without a finished string
                best = max(run.live, key=lambda p: p.logw)
            if best is None:  # every beam reached psi = 0 (only possible under a grammar)
                raise GenerationError(
                    "every smc beam reached a text the members give probability 0 under the "
                    "grammar; raise SmcConfig.beam_width or prune_threshold=0."
                )
            return best, {"beam_steps": run.steps, "finished_candidates": len(run.done), "best_log_psi": best.logw}
        # only particles that start with what was streamed can be the answer (a particle that
        # died before the others agreed may not)
        best = self._pick(run, sent_bytes)
        post = run.posterior()
        return best, {
            "smc_steps": run.steps,
            "resamplings": run.resamplings,
            "ess": [round(e, 3) for e in run.ess],
            "log_z": run.log_z,
            "distinct_texts": len(post),
            "best_weight": round(post[best.text], 4),
        }

    def _report(self, req: Request, run, best: Particle, search: bool, heals: int, stats: dict) -> None:
        cfg = self.config
        text = best.text.decode("utf-8", errors="replace")
        req.stats = SmcStats(
            tokens_out=len(self.members[req.main].encode(text)) if text else 0,
            bytes_out=len(best.text),
            search="beam" if search else "smc",
            heals=heals,
            f=cfg.f if cfg.f != "power" else f"power({cfg.tau:g})",
            n_particles=cfg.n_particles,
            **stats,
        )
        if cfg.return_particles and not search:
            req.stats.particles = [
                {"text": p.text.decode("utf-8", errors="replace"), "weight": float(w), "finish": p.done}
                for p, w in zip(run.particles, run.normalised())
            ]
        elif cfg.return_particles:
            req.stats.particles = [
                {"text": p.text.decode("utf-8", errors="replace"), "log_psi": p.logw, "finish": p.done}
                for p in sorted(run.done, key=lambda p: -p.logw)
            ]

    @staticmethod
    def _pick(run: SmcRun, prefix: bytes = b"") -> Particle:
        """The text with the largest total weight (duplicates merged) among those starting with
        `prefix`; ties go to the text the members jointly find more probable."""
        post = run.posterior()
        pool = [p for p in run.particles if p.text.startswith(prefix)] or run.particles
        return max(pool, key=lambda p: (post[p.text], float(p.lp.sum())))


class _Ending:
    """Why a particle stops after a byte (`finished` in the samplers): the grammar is complete, a
    stop string (cut off), the budget-aware closing, or the token / byte budget."""

    def __init__(self, req: Request, max_bytes: int) -> None:
        self.req, self.guide, self.main, self.max_bytes = req, req.guide, req.main, max_bytes
        self.closed: set[bytes] = set()  # texts the budget-aware closing completed
        if self.guide:
            self.guide.check_budget(self.main, req.max_new_tokens)

    def __call__(self, p: Particle) -> str | None:
        guide = self.guide
        if guide and guide.complete(p.text):  # the grammar allows nothing more
            return "stop"
        cut = self.req.stops.cut_suffix(p.text)  # the longest stop first: cut where the engine would cut
        if cut is not None:
            p.text = cut
            return "stop"
        if guide and self.close(p):
            return "length"
        if p.states[self.main].tokens >= self.req.max_new_tokens or len(p.text) >= self.max_bytes:
            return "length"
        return None

    def close(self, p: Particle) -> bool:
        """Budget-aware closing of one particle: when its tokens or bytes left are just what the
        shortest completion needs, the completion is appended (the particle ends there, its
        byte-LM states no longer used). When its last byte already left too little, the
        completion of the text before that byte is written instead (it fit one byte ago)."""
        guide = self.guide
        tokens_left = self.req.max_new_tokens - p.states[self.main].tokens
        bytes_left = self.max_bytes - len(p.text)
        tail = guide.completion(p.text)
        need = guide.reserve(self.main, p.text)
        if tail is None or not need:
            return False
        if need - CLOSE_MARGIN > tokens_left or len(tail) > bytes_left:  # the last byte overdrew
            base = p.text[:-1]
            tail = guide.completion(base)
            if tail is None:
                return False
            p.text = base + tail
        elif need >= tokens_left or len(tail) + CLOSE_MARGIN >= bytes_left:
            p.text += tail
        else:
            return False
        self.closed.add(p.text)
        return True
