"""`Ensemble`: owns the members and one method; generate / stream / agenerate / astream.

All requests of one engine run one at a time, in order, on a single worker thread that owns the
models: concurrent callers (threads or asyncio tasks) can never corrupt a KV cache or interleave
output, and async callers never block their event loop. A failed request raises in its caller
and leaves the engine usable.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

import torch

from .errors import ConfigError, EnsembleError, GenerationError, RequestError
from .members import DEFAULT_MODELS, Member, load_member, resolve_device, resolve_dtype, resolve_source
from .methods import Request, get_method
from .stopping import StopMatcher

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens}


@dataclass
class GenerationResult:
    text: str
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    usage: Usage
    stats: dict[str, Any] = field(default_factory=dict)
    method: str = ""
    models: list[str] = field(default_factory=list)


@dataclass
class _Params:
    prompt: str | list[dict]
    raw: bool
    tools: list[dict] | None
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]


class TextStream:
    """Iterates over text deltas as the engine decides them; `.result` is set at the end."""

    def __init__(self, items: "queue.Queue", cancel: threading.Event) -> None:
        self._items = items
        self._cancel = cancel
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        try:
            while True:
                kind, payload = self._items.get()
                if kind == "delta":
                    yield payload
                elif kind == "done":
                    self.result = payload
                    return
                else:
                    raise payload
        finally:
            if self.result is None:
                self._cancel.set()


class AsyncTextStream:
    """Async twin of TextStream; never blocks the event loop."""

    def __init__(self, items: "asyncio.Queue", cancel: threading.Event) -> None:
        self._items = items
        self._cancel = cancel
        self.result: GenerationResult | None = None

    async def __aiter__(self) -> AsyncIterator[str]:
        try:
            while True:
                kind, payload = await self._items.get()
                if kind == "delta":
                    yield payload
                elif kind == "done":
                    self.result = payload
                    return
                else:
                    raise payload
        finally:
            if self.result is None:
                self._cancel.set()


class Ensemble:
    """Several causal LMs decoded together by one ensembling method.

    members: bundled names, local folders, local .gguf files or cached hub ids (default: the
        bundled SmolLM2-135M-Instruct + Gemma-3-270M pair; the first member drafts).
    method: "single" (more as they land); config: the method's config dataclass or a dict.
    device: "auto" (CUDA when present, else CPU), a device, or one device per member.
    dtype: "auto" (bf16 on CUDA, fp32 on CPU) or a torch dtype / name.
    Weights load on first use (or `load()`), once per process for the same model and device.
    """

    def __init__(self, members: Sequence[str] | None = None, method: str = "single", config: Any = None, *,
                 device: Any = "auto", dtype: Any = "auto", cache_dir: str | os.PathLike | None = None,
                 trust_remote_code: bool = False, progress: bool = True) -> None:
        if members is None:
            members = list(DEFAULT_MODELS)
        if isinstance(members, (str, os.PathLike)):
            members = [members]
        members = list(members)
        if not members:
            raise ConfigError("members is empty; name at least one model, e.g. members=['smollm2-135m-instruct'].")
        self.sources = [resolve_source(m) for m in members]
        devices = list(device) if isinstance(device, (list, tuple)) else [device] * len(members)
        if len(devices) != len(members):
            raise ConfigError(f"device lists {len(devices)} entries for {len(members)} members; give one per member.")
        self.devices = [resolve_device(d) for d in devices]
        self.dtypes = [resolve_dtype(dtype, d) for d in self.devices]
        if not isinstance(method, str):
            raise ConfigError(f"method must be a method name (str), got {method!r}")
        self.method_name = method
        self.method_class = get_method(method)
        self.config = self.method_class.make_config(config)
        self.cache_dir = cache_dir
        self.trust_remote_code = bool(trust_remote_code)
        self.progress = progress
        self._members: list[Member] | None = None
        self._method = None
        self._load_lock = threading.Lock()
        self._jobs: "queue.Queue" = queue.Queue()
        self._worker: threading.Thread | None = None
        self._worker_lock = threading.Lock()

    # ---- loading -------------------------------------------------------------------------
    @property
    def model_names(self) -> list[str]:
        return [s.name for s in self.sources]

    @property
    def members(self) -> list[Member]:
        return self.load()._members  # type: ignore[return-value]

    def load(self) -> "Ensemble":
        """Load every member now (otherwise the first request does)."""
        with self._load_lock:
            if self._members is None:
                members = [
                    load_member(s.ref, device=d, dtype=t, cache_dir=self.cache_dir,
                                trust_remote_code=self.trust_remote_code, progress=self.progress)
                    for s, d, t in zip(self.sources, self.devices, self.dtypes)
                ]
                method = self.method_class(members, self.config)
                method.check_members()
                self._members, self._method = members, method
        return self

    def __repr__(self) -> str:
        return f"Ensemble(members={self.model_names}, method={self.method_name!r})"

    # ---- public API ----------------------------------------------------------------------
    def generate(self, prompt, **kw) -> GenerationResult:
        """Run one request to the end. kw: max_new_tokens=128, temperature=0.0, top_p=1.0,
        seed=None, stop=None, raw=False (prompt text used as is, no chat template), tools=None."""
        stream = self.stream(prompt, **kw)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, prompt, **kw) -> TextStream:
        """Text deltas as they are decided; the stream's `.result` holds usage and stats at the end."""
        params = self._check(prompt, **kw)
        items: "queue.Queue" = queue.Queue()
        cancel = threading.Event()
        self._submit(params, lambda kind, payload: items.put((kind, payload)), cancel)
        return TextStream(items, cancel)

    async def agenerate(self, prompt, **kw) -> GenerationResult:
        stream = self.astream(prompt, **kw)
        async for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def astream(self, prompt, **kw) -> AsyncTextStream:
        params = self._check(prompt, **kw)
        loop = asyncio.get_running_loop()
        items: "asyncio.Queue" = asyncio.Queue()
        cancel = threading.Event()

        def sink(kind, payload):
            try:
                loop.call_soon_threadsafe(items.put_nowait, (kind, payload))
            except RuntimeError:  # the caller's loop is gone: nobody is listening any more
                cancel.set()

        self._submit(params, sink, cancel)
        return AsyncTextStream(items, cancel)

    # ---- validation ----------------------------------------------------------------------
    @staticmethod
    def _check(prompt, *, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
               seed: int | None = None, stop: str | Sequence[str] | None = None, raw: bool = False,
               tools: list[dict] | None = None) -> _Params:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise RequestError("the prompt is empty; pass a non-empty string or a list of messages.")
        elif isinstance(prompt, (list, tuple)):
            if not prompt:
                raise RequestError("the message list is empty; pass at least one {'role': 'user', 'content': ...}.")
            for i, m in enumerate(prompt):
                if not isinstance(m, dict) or m.get("role") not in ROLES:
                    raise RequestError(f"message {i} must be a dict with 'role' in {ROLES}, got {m!r}")
            if raw:
                raise RequestError("raw=True takes a prompt string, not messages.")
            prompt = [dict(m) for m in prompt]
        else:
            raise RequestError(f"prompt must be a string or a list of messages, got {type(prompt).__name__}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise RequestError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if not isinstance(temperature, (int, float)) or temperature < 0 or temperature != temperature:
            raise RequestError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {top_p!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise RequestError(f"seed must be an integer or None, got {seed!r}")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) for s in stops):
            raise RequestError(f"stop must be a string or a list of strings, got {stop!r}")
        return _Params(prompt, bool(raw), tools, max_new_tokens, float(temperature), float(top_p), seed,
                       [s for s in stops if s])

    # ---- the worker ----------------------------------------------------------------------
    def _submit(self, params: _Params, sink: Callable, cancel: threading.Event) -> None:
        with self._worker_lock:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work, name="ensemble-llm-worker", daemon=True)
                self._worker.start()
        self._jobs.put((params, sink, cancel))

    def _work(self) -> None:
        while True:
            params, sink, cancel = self._jobs.get()
            if cancel.is_set():
                continue
            try:
                result = self._execute(params, lambda d: sink("delta", d), cancel)
                sink("done", result)
            except EnsembleError as exc:
                sink("error", exc)
            except Exception as exc:  # noqa: BLE001 - surfaced to the caller, the worker lives on
                err = GenerationError(f"generation failed: {type(exc).__name__}: {exc}")
                err.__cause__ = exc
                sink("error", err)

    def _prompts(self, params: _Params, members: list[Member]) -> tuple[list[list[int]], list[str]]:
        ids, stops = [], list(params.stop)
        for m in members:
            if params.raw:
                text = params.prompt
            else:
                msgs = [{"role": "user", "content": params.prompt}] if isinstance(params.prompt, str) else params.prompt
                text = m.render_chat(msgs, tools=params.tools)
                stops += [s for s in m.chat_stop_strings if s not in stops]
            ids.append(m.prompt_ids(text))
        return ids, stops

    def _execute(self, params: _Params, emit: Callable[[str], None], cancel: threading.Event) -> GenerationResult:
        t0 = time.perf_counter()
        members = self.members
        method = self._method
        prompt_ids, stops = self._prompts(params, members)
        room = []
        for m, ids in zip(members, prompt_ids):
            if len(ids) >= m.context_window:
                raise RequestError(
                    f"the prompt is {len(ids)} tokens for {m.name}, whose context window is {m.context_window}; "
                    "shorten the prompt or drop that member.")
            room.append(m.context_window - len(ids))
        budget = min(params.max_new_tokens, *room)
        generator = torch.Generator()
        generator.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        req = Request(prompt_ids, budget, params.temperature, params.top_p, generator)
        before = [(m.n_forward, m.forward_time) for m in members]
        matcher = StopMatcher(stops)
        pieces: list[str] = []
        first_chunk = None
        gen = method.run(req)
        try:
            for piece in gen:
                out = matcher.feed(piece)
                if out:
                    pieces.append(out)
                    if first_chunk is None:
                        first_chunk = time.perf_counter() - t0
                    emit(out)
                if matcher.stopped or cancel.is_set():
                    req.finish_reason = "stop"
                    break
        finally:
            gen.close()
        tail = matcher.flush()
        if tail:
            pieces.append(tail)
            emit(tail)
        text = "".join(pieces)
        main = method.main_member()
        usage = Usage(len(prompt_ids[main]), len(members[main].encode(text)) if text else 0)
        stats = dict(req.stats)
        stats["members"] = {
            m.name: {"forward_passes": m.n_forward - n0, "forward_time_s": round(m.forward_time - t0_, 4)}
            for m, (n0, t0_) in zip(members, before)
        }
        stats["time_s"] = round(time.perf_counter() - t0, 4)
        stats["time_to_first_chunk_s"] = None if first_chunk is None else round(first_chunk, 4)
        return GenerationResult(text, req.finish_reason, usage, stats, self.method_name, self.model_names)
