"""`weights="auto"`: member weights that follow each member's measured competence.

Competence is measured once per member on a small bundled calibration sample
(`data/calibration.jsonl`: 43 short general-knowledge facts, none of them from the bench's dev
or chat sets), in the two prompt kinds the engine serves:
- "raw": a 3-shot "Q: ... A: ..." completion prompt; the target is " <answer>\\n";
- "chat": the fact as a question ("The capital of Japan is" -> "What is the capital of Japan?") in
  one user message in the member's own chat format (its template, or the plain transcript with its
  preamble); the target is a one-sentence reply ("The capital of Japan is Tokyo.").
For member k and example i, ll[i, k] = log p_k(target_i | prompt_i): the log-probability of the
target *string* (its canonical tokens, one forward), which is comparable across tokenizers.

Weights are the mixture weights that maximise the calibration likelihood of the mixture,
    w* = argmax_w  sum_i log sum_k w_k exp(ll[i, k]),
found by EM (the classic way to fit interpolation weights of language models on held-out text):
    r[i, k] = w_k p_ik / sum_j w_j p_ij;   w_k = mean_i r[i, k].
A member that is never more likely than the others gets little weight; members that are right on
different examples share it.

Chat weights are calibrated on answering, not on likelihood: a member's greedy reply to each
question (up to `ANSWER_TOKENS` tokens, its end of turn or its chat stop strings) is right when it
names an accepted answer, and the weights are the mixture weights of "which member answers",
EM on p[i, k] = ANSWER_EPS + (1 - 2 ANSWER_EPS) right[i, k] (`answer_weights`). A likelihood
rewards a member that finds the reference reply probable, and a terse base model does, while
its own replies miss the answer (docs/benchmarks/formats.md).

Per-member log-likelihoods and answers are cached on disk (JSON, keyed by the model, its preamble
and the data), so a member set is calibrated once per machine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from filelock import FileLock, Timeout

from .members import TokenLM
from .members.fetch import cache_root

log = logging.getLogger("ensemble_llm")
KINDS = ("raw", "chat")
SHOTS = 3
ANSWER_TOKENS = 32  # a calibration reply's budget: the facts' answers come in its first sentence
ANSWER_EPS = 0.05  # answer_weights: the chance that the member that answers misses, or another hits


def _data_dir() -> Path:
    return Path(str(resources.files("ensemble_llm") / "data"))


def calibration_data() -> list[dict]:
    path = _data_dir() / "calibration.jsonl"
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def raw_prompt(data: list[dict], i: int) -> str:
    shots = "".join(f"Q: {x['input']}\nA: {x['targets'][0]}\n" for x in data[:SHOTS])
    return shots + f"Q: {data[i]['input']}\nA:"


def as_question(statement: str) -> str:
    """'The capital of Japan is' -> 'What is the capital of Japan?' (the sample's statement form)."""
    s = statement.strip()
    if s.startswith("The ") and s.endswith(" is"):
        return "What is the " + s[4:-3] + "?"
    return s + " ...?"


BUNDLED_LOGLIKS = "calibration_bundled.json"  # in data/: written by `write_bundled_logliks`


def _model_of(name: str) -> str:
    """The member in a cache entry's name ("chat:gemma-3-270m|null|torch.float32|llama.cpp")."""
    return name.split(":", 1)[1].split("|", 1)[0]


def bundled_logliks(data_digest: str, shipped_path: Path | None = None) -> dict[str, list[float]]:
    """The bundled models' calibration log-likelihoods (and chat answers) as they ship with the
    package, so that a first request does not spend seconds scoring the sample: only entries
    measured on this calibration sample and on the very file the registry pins now (its sha256),
    for the bundled name the entry is keyed by."""
    from .members.registry import BUNDLED

    path = shipped_path or _data_dir() / BUNDLED_LOGLIKS
    try:
        shipped = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if shipped.get("data_digest") != data_digest:
        return {}
    out = {}
    for name, entry in shipped.get("entries", {}).items():
        model = _model_of(name)
        if model in BUNDLED and BUNDLED[model].sha256 == entry.get("sha256"):
            out[name] = entry["loglik"]
    return out


def write_bundled_logliks(cache_dir=None) -> Path:
    """Write data/calibration_bundled.json from this machine's calibration cache: the entries of
    bundled models with no preamble change (run after the bundled files or the sample change,
    once the pair has served a chat and a raw request)."""
    from .members.registry import BUNDLED

    calibrator = Calibrator(cache_dir)
    disk = json.loads(calibrator.path.read_text())
    entries = {
        name: {"sha256": BUNDLED[_model_of(name)].sha256, "loglik": loglik}
        for name, loglik in sorted(disk.items())
        if _model_of(name) in BUNDLED
    }
    out = _data_dir() / BUNDLED_LOGLIKS
    out.write_text(json.dumps({"data_digest": calibrator.digest, "entries": entries}, indent=1) + "\n")
    return out


def target_logprob(member: TokenLM, prompt_ids: list[int], target: str) -> float:
    """log p(target | prompt) under `member`: the target's canonical tokens scored in one forward."""
    return member.target_logprob(prompt_ids, member.encode(target))


def em_weights(ll: np.ndarray, iters: int = 500, tol: float = 1e-9) -> np.ndarray:
    """Mixture weights maximising sum_i log sum_k w_k exp(ll[i, k]) (EM from uniform)."""
    n, k = ll.shape
    w = np.full(k, 1.0 / k)
    for _ in range(iters):
        a = ll + np.log(np.maximum(w, 1e-300))
        r = np.exp(a - np.logaddexp.reduce(a, axis=1, keepdims=True))
        new = r.mean(axis=0)
        if np.abs(new - w).max() < tol:
            return new
        w = new
    return w


def answer_weights(right: np.ndarray) -> np.ndarray:
    """Mixture weights of "which member answers" from right[i, k] in {0, 1} (module doc)."""
    return em_weights(np.log(ANSWER_EPS + (1 - 2 * ANSWER_EPS) * np.asarray(right, dtype=float)))


def greedy_reply(member: TokenLM, prompt_ids: list[int], stops: Sequence[str], budget: int = ANSWER_TOKENS) -> str:
    """The member's greedy reply to a prompt: up to an end-of-turn token, a stop string or `budget` tokens."""
    from .members.rows import pick_token

    state, out = member.prefill(prompt_ids), []
    row = member.ensure_next(state)
    while len(out) < budget:
        tok = pick_token(row)  # greedy, whatever the row type (in process, on a server, in Ray)
        if tok in member.eos_ids:
            break
        out.append(tok)
        row = member.extend(state, [tok], last_only=True)[-1]
    text = member.decode(out)
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=len(text))
    return text[:cut]


def names_answer(reply: str, targets: Sequence[str]) -> bool:
    low = reply.lower()
    return any(t.lower() in low for t in targets)


class Calibrator:
    """Per-member calibration log-likelihoods, computed once and cached on disk."""

    def __init__(self, cache_dir=None) -> None:
        self.data = calibration_data()
        self.digest = hashlib.sha256(json.dumps(self.data, sort_keys=True).encode()).hexdigest()[:12]
        self.path = cache_root(cache_dir) / "calibration" / f"loglik-{self.digest}.json"
        self._memo: dict[str, list[float]] | None = None

    def _load(self) -> dict[str, list[float]]:
        if self._memo is None:
            try:
                self._memo = json.loads(self.path.read_text())
            except (OSError, ValueError):
                self._memo = {}
            for name, loglik in bundled_logliks(self.digest).items():
                self._memo.setdefault(name, loglik)
        return self._memo

    def _save(self, name: str) -> None:
        """Merge entry `name` into the cache file under a file lock (other processes may be
        calibrating other members into the same file)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(self.path) + ".lock", timeout=60):
                try:
                    disk = json.loads(self.path.read_text())
                except (OSError, ValueError):
                    disk = {}
                disk[name] = self._memo[name]
                tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(disk))
                tmp.replace(self.path)
        except (OSError, Timeout) as exc:  # a read-only cache only costs a recomputation next time
            log.warning("could not save calibration cache %s: %s", self.path, exc)

    def loglik(self, member: TokenLM, key: str, kind: str, chat_prompt: Callable[[str], str]) -> list[float]:
        """ll of every scored example for one member. `key` identifies the member (model and
        preamble); `chat_prompt(question)` renders a question in the member's chat format."""
        memo = self._load()
        name = f"{kind}:{key}"
        if name not in memo:
            out = []
            for i in range(SHOTS, len(self.data)):
                ex = self.data[i]
                if kind == "raw":
                    prompt, target = raw_prompt(self.data, i), " " + ex["targets"][0] + "\n"
                else:
                    prompt, target = chat_prompt(as_question(ex["input"])), ex["reply"]
                out.append(target_logprob(member, member.prompt_ids(prompt), target))
            memo[name] = out
            self._save(name)
        return memo[name]

    def answers(self, member: TokenLM, key: str, chat_prompt: Callable[[str], str]) -> list[float]:
        """1.0 where the member's greedy chat reply names the answer, else 0.0, per scored example."""
        from .chat import chat_stops

        memo = self._load()
        name = f"answer:{key}"
        if name not in memo:
            out = []
            for ex in self.data[SHOTS:]:
                reply = greedy_reply(
                    member, member.prompt_ids(chat_prompt(as_question(ex["input"]))), chat_stops(member)
                )
                out.append(float(names_answer(reply, ex["targets"])))
            memo[name] = out
            self._save(name)
        return memo[name]

    def weights(
        self, members: Sequence[TokenLM], keys: Sequence[str], kind: str, chat_prompt: Callable[[int, str], str]
    ) -> list[float]:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if kind == "chat":
            right = [
                self.answers(m, k, lambda q, i=i: chat_prompt(i, q)) for i, (m, k) in enumerate(zip(members, keys))
            ]
            return [float(x) for x in answer_weights(np.array(right).T)]
        ll = np.array(
            [self.loglik(m, k, kind, lambda q, i=i: chat_prompt(i, q)) for i, (m, k) in enumerate(zip(members, keys))]
        ).T  # [N, K]
        w = em_weights(ll)
        return [float(x) for x in w]


class EngineWeights:
    """An engine's member weights and main member per prompt kind (`Ensemble.member_weights`).

    Weights: the method config's list; uniform for None; for "auto", the mixture weights that best
    explain the calibration sample in that prompt kind (measured once per member and cached on
    disk, kept here for the engine's life). The main member (drafter / primary) is the config's,
    else the one with the largest weight, else (uniform weights) the one with the most parameters."""

    def __init__(
        self, cache_dir, sources: Sequence, preambles: Sequence, chat_prompt: Callable[[int, str], str]
    ) -> None:
        self.cache_dir, self.sources, self.preambles, self.chat_prompt = cache_dir, sources, preambles, chat_prompt
        self._auto: dict[str, list[float]] = {}

    def of(self, kind: str, members: Sequence[TokenLM], method: Any) -> tuple[list[float], int]:
        method = method.for_kind(kind == "raw")
        given = method.member_weights()
        if isinstance(given, str) and given == "auto" and len(members) > 1:
            if kind not in self._auto:
                keys = [  # what computes the log-probs too: llama.cpp's quantized kernels are not transformers'
                    f"{s.ref}|{json.dumps(p, sort_keys=True)}|{m.dtype}{'|' * bool(m.numerics)}{m.numerics}"
                    for s, p, m in zip(self.sources, self.preambles, members)
                ]
                self._auto[kind] = Calibrator(self.cache_dir).weights(members, keys, kind, self.chat_prompt)
            weights = list(self._auto[kind])
        elif isinstance(given, (list, tuple)):
            total = float(sum(given))
            weights = [float(w) / total for w in given]
        else:
            weights = [1.0 / len(members)] * len(members)
        main = method.main_member()
        if main is None:
            if len(set(weights)) > 1:
                main = max(range(len(members)), key=lambda i: (weights[i], -i))
            else:
                main = max(range(len(members)), key=lambda i: (members[i].n_params, -i))
        return weights, main
