"""`Ensemble`: owns the members and one method; generate / stream / agenerate / astream.

All requests of one engine run one at a time, in order, on a single worker thread that owns the
models: concurrent callers (threads or asyncio tasks) can never corrupt a KV cache or interleave
output, and async callers never block their event loop. A failed request raises in its caller
and leaves the engine usable.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

import torch

from .chat import (BASE_PREAMBLE, ToolCall, ToolTextFilter, call_key, check_preamble, content_text, history_calls,
                   member_messages, with_preamble)
from .constraints import Guide
from .evidence import answer_positions, answer_spans, chat_spans, posterior
from .errors import ConfigError, EnsembleError, GenerationError, RequestCancelled, RequestError, RequestTimeout
from .members import DEFAULT_MODELS, Member, load_member, resolve_device, resolve_dtype, resolve_source
from .members.loader import local_dir
from .members.member import forward_guard
from .methods import Request, get_method
from .methods.base import RunStats
from .params import FIELDS as PARAM_FIELDS
from .params import GenerationParams, _check_text
from .stopping import StopMatcher

ROLES = ("system", "user", "assistant", "tool")
_SHARED: dict[tuple, "Ensemble"] = {}
_SHARED_LOCK = threading.Lock()


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
    text: str  # the reply's content (tool-call markup removed when tools were given)
    finish_reason: str  # "stop" (EOS or stop string), "length" or "tool_calls"
    usage: Usage
    stats: dict[str, Any] = field(default_factory=dict)
    method: str = ""
    models: list[str] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    raw_text: str = ""  # the reply's whole text, tool-call markup (and a forced call's fixed head) included
    run_stats: RunStats | None = None  # the method's own figures, typed (its Method.stats_class)


@dataclass
class _Job:
    """One queued request: the prompt, its settings and when it was submitted."""

    prompt: str | list[dict]
    params: GenerationParams
    submitted: float = field(default_factory=time.perf_counter)  # the timeout counts from here
    shows_text: bool = True  # a stream's deltas reach the caller; generate() only keeps the result

    @property
    def head(self) -> str:
        """The reply's fixed start that ends every member's prompt instead of being generated
        (`Constraint.head`: a forced call to the one allowed tool); "" for other requests."""
        return self.params.constraint.head if self.params.constraint else ""

    def check_deadline(self) -> None:
        """RequestTimeout once `timeout` seconds have passed since the request was submitted
        (time waiting in the queue, loading and any retry all count)."""
        timeout = self.params.timeout
        if timeout is not None and time.perf_counter() - self.submitted > timeout:
            raise RequestTimeout(f"the request took longer than timeout={timeout:g} s (queue wait included); "
                                 "raise the timeout or lower max_new_tokens.")


def _check_message(m: Any, i: int) -> None:
    """One chat message: a known role, and text content the members can read. Content is a string
    or a list of text parts; image/audio parts and other objects are refused, naming the part.
    Empty content is refused too, except for an assistant turn that carries tool calls."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise RequestError(f"message {i} must be a dict with 'role' in {ROLES}, got {m!r}")
    content = m.get("content")
    if isinstance(content, (list, tuple)):
        for j, part in enumerate(content):
            if isinstance(part, str):
                continue
            if isinstance(part, dict) and part.get("type", "text") == "text":
                if isinstance(part.get("text"), str):
                    continue
                raise RequestError(f"message {i} ({m.get('role')}) content part {j} is a text part with no string "
                                   f"'text' (got {part.get('text')!r}); give it {{'type': 'text', 'text': '...'}}.")
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"message {i} ({m['role']}) content part {j} is {kind!r}, which these text-only "
                               "models cannot read; send text parts ({'type': 'text', 'text': ...}) only.")
    elif content is not None and not isinstance(content, str):
        raise RequestError(f"message {i} ({m['role']}) content must be a string or a list of text parts, "
                           f"got {type(content).__name__}")
    text = content_text(content)
    calls = m.get("tool_calls")
    if calls is not None:
        if m["role"] != "assistant" or not isinstance(calls, (list, tuple)) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) for c in calls):
            raise RequestError(f"message {i}: tool_calls belong to assistant messages and look like "
                               "[{'id': ..., 'type': 'function', 'function': {'name': ..., 'arguments': ...}}], "
                               f"got {calls!r}")
    if m["role"] == "tool" and not (isinstance(m.get("tool_call_id"), str) and m["tool_call_id"]):
        raise RequestError(f"message {i} (tool) has no tool_call_id (got {m.get('tool_call_id')!r}); a tool "
                           "result must name the call it answers: give it the 'tool_call_id' of that call "
                           "(the id in the assistant message's tool_calls).")
    if not text.strip() and not (m["role"] == "assistant" and calls) and m["role"] != "tool":
        raise RequestError(f"message {i} ({m['role']}) has no text content; give it non-empty 'content'.")
    _check_text(text, f"message {i} ({m['role']})")


MEMBER_KEYS = ("model", "preamble")


def _member_spec(spec: Any, i: int) -> tuple[Any, list[dict] | None]:
    """A member is a model (bundled name, folder, .gguf, hub id) or a dict {"model": ...,
    "preamble": [messages]} that pairs the model with turns put before its chat prompts."""
    if not isinstance(spec, dict):
        return spec, None
    unknown = sorted(set(spec) - set(MEMBER_KEYS))
    if unknown or "model" not in spec:
        raise ConfigError(f"member {i} is a dict, so it needs a 'model' and may have {list(MEMBER_KEYS[1:])}; "
                          f"got keys {sorted(spec)}")
    return spec["model"], check_preamble(spec.get("preamble"), f"member {i} ({spec['model']})")


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()  # a keyword the caller did not give (its value comes from `params` or the default)


# the constructor's keyword options after members / method / config; the facades mirror them as fields
ENGINE_OPTIONS = ("device", "dtype", "cache_dir", "trust_remote_code", "progress", "placement", "ray_address",
                  "member_resources")


def _given(scope: dict[str, Any]) -> dict[str, Any]:
    """The settings among a public method's keywords that the caller gave."""
    return {k: scope[k] for k in PARAM_FIELDS if k in scope and scope[k] is not UNSET}


def _check_prompt(prompt: Any, raw: bool) -> str | list[dict]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise RequestError("the prompt is empty; pass a non-empty string or a list of messages.")
        _check_text(prompt, "the prompt")
        return prompt
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise RequestError("the message list is empty; pass at least one {'role': 'user', 'content': ...}.")
        for i, m in enumerate(prompt):
            _check_message(m, i)
        if raw:
            raise RequestError("raw=True takes a prompt string, not messages.")
        return [dict(m) for m in prompt]
    raise RequestError(f"prompt must be a string or a list of messages, got {type(prompt).__name__}")


def _jsonable(entry: dict) -> dict:
    """A trace entry with byte strings as text (EOS as '<eos>'), ready for JSON."""
    out = {}
    for k, v in entry.items():
        if isinstance(v, bytes):
            v = v.decode("utf-8", errors="replace")
        elif v is not None and not isinstance(v, (str, int, float, bool, list, dict)):
            v = "<eos>"
        out[k] = v
    return out


@dataclass
class _Output:
    """What goes to the caller: text deltas, and when the first one left."""

    emit: Callable[[str], None]
    t0: float
    first: float | None = None

    def send(self, text: str) -> None:
        if text:
            if self.first is None:
                self.first = time.perf_counter() - self.t0
            self.emit(text)


@dataclass
class _Run:
    """One method run of a request: its Request (stats, finish reason) and the reply's parts."""

    req: Request
    filter: ToolTextFilter
    tail: str = ""
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)  # the engine's own figures (tool policy)


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
        bundled SmolLM2-135M-Instruct + Gemma-3-270M pair), or {"model": ..., "preamble": [...]}
        dicts; the main member (drafter) is the strongest unless the method config names one.
    method: "single", "unite", "safe", "specfuse", "smc" (default: "safe" for 2+ members, else "single");
        config: the method's config dataclass or a dict.
    device: "auto" (CUDA when present, else CPU), a device, or one device per member.
    dtype: "auto" (bf16 on CUDA, fp32 on CPU) or a torch dtype / name.
    Weights load on first use (or `load()`), once per process for the same model and device.
    """

    def __init__(self, members: Sequence[str] | None = None, method: str | None = None, config: Any = None, *,
                 device: Any = "auto", dtype: Any = "auto", cache_dir: str | os.PathLike | None = None,
                 trust_remote_code: bool = False, progress: bool = True, placement: str = "local",
                 ray_address: str | None = None, member_resources: Any = None) -> None:
        if members is None:
            members = list(DEFAULT_MODELS)
        if isinstance(members, (str, os.PathLike, dict)):
            members = [members]
        members = list(members)
        if not members:
            raise ConfigError("members is empty; name at least one model, e.g. members=['smollm2-135m-instruct'].")
        self.sources, self.preambles = [], []
        for i, spec in enumerate(members):
            model, preamble = _member_spec(spec, i)
            self.sources.append(resolve_source(model))
            self.preambles.append(preamble)
        if placement not in ("local", "ray"):
            raise ConfigError(f"placement must be 'local' (members in this process) or 'ray' (each member in a "
                              f"Ray actor), got {placement!r}")
        self.placement = placement
        if ray_address is not None and (placement != "ray" or not isinstance(ray_address, str)):
            raise ConfigError(f"ray_address={ray_address!r} needs placement='ray' and a string address "
                              "('auto', 'ray://HEAD:10001' or 'HOST:6379')")
        if member_resources is not None and placement != "ray":
            raise ConfigError("member_resources applies to placement='ray' only (Ray resources per member actor)")
        self.ray_address = ray_address
        devices = list(device) if isinstance(device, (list, tuple)) else [device] * len(members)
        if len(devices) != len(members):
            raise ConfigError(f"device lists {len(devices)} entries for {len(members)} members; give one per member.")
        if placement == "ray":
            from .members.remote import check_member_resources

            if any(d not in ("auto", None) for d in devices):
                raise ConfigError("with placement='ray' each member's device is its actor's: a GPU where "
                                  "member_resources gives it one (the default on a cluster with GPUs), else the "
                                  "CPU; leave device='auto' and set member_resources=[{'num_gpus': 1}, ...].")
            self.member_resources = check_member_resources(member_resources, len(members))
            resolve_dtype(dtype, torch.device("cpu"))  # a bad name fails here; "auto" is resolved by each actor
            self.devices = [torch.device("cpu")] * len(members)  # the caller's side; see RayMember.actor_device
            name = "auto" if dtype is None else dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
            self.dtypes = [name] * len(members)
        else:
            self.member_resources = None
            self.devices = [resolve_device(d) for d in devices]
            self.dtypes = [resolve_dtype(dtype, d) for d in self.devices]
        if method is None:
            method = "safe" if len(members) > 1 else "single"
        if not isinstance(method, str):
            raise ConfigError(f"method must be a method name (str), got {method!r}")
        self.method_name = method
        self.method_class = get_method(method)
        self.config = self.method_class.make_config(config)
        # member-count rules (>= 2 members, indices and weights per member) need no weights: check now
        self.method_class(self.sources, self.config).check_members()
        self.cache_dir = cache_dir
        self.trust_remote_code = bool(trust_remote_code)
        self.progress = progress
        self._members: list[Member] | None = None
        self._method = None
        self._auto: dict[str, list[float]] = {}  # "auto" weights per prompt kind, once calibrated
        self._load_lock = threading.RLock()  # load() calibrates "auto" weights, which asks for the members
        self._jobs: "queue.Queue" = queue.Queue()
        self._worker: threading.Thread | None = None
        self._worker_lock = threading.Lock()

    @classmethod
    def shared(cls, members: Sequence[str] | None = None, method: str | None = None, config: Any = None,
               **kw) -> "Ensemble":
        """The process-wide engine for these arguments: built once, then returned again, so many
        framework objects (LangChain and LlamaIndex facades alike) share loaded models and one
        request queue. Arguments are validated exactly as by the constructor."""
        eng = cls(members, method, config, **kw)
        key = (tuple(s.ref for s in eng.sources), repr(eng.preambles), eng.method_name, repr(eng.config), tuple(map(str, eng.devices)),
               tuple(map(str, eng.dtypes)), str(eng.cache_dir), eng.trust_remote_code, eng.placement, eng.ray_address,
               repr(eng.member_resources))
        with _SHARED_LOCK:
            return _SHARED.setdefault(key, eng)

    @classmethod
    def shared_or_given(cls, engine: Any, members: Sequence[str] | None, method: str | None, config: Any,
                        **kw) -> "Ensemble":
        """What the framework facades hold: `engine` when the caller passed one (it must be an
        Ensemble), else the process-wide engine for the other arguments (`shared`)."""
        if engine is None:
            return cls.shared(members, method, config, **kw)
        if not isinstance(engine, cls):
            raise ConfigError(f"engine must be an ensemble_llm.Ensemble, got {type(engine).__name__}")
        return engine

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
                if self.placement == "ray":
                    members = self._place_on_ray()
                else:
                    members = [
                        load_member(s.ref, device=d, dtype=t, cache_dir=self.cache_dir,
                                    trust_remote_code=self.trust_remote_code, progress=self.progress)
                        for s, d, t in zip(self.sources, self.devices, self.dtypes)
                    ]
                method = self.method_class(members, self.config)
                method.check_members()
                self._members, self._method = members, method
                for kind in ("chat", "raw"):  # "auto" weights: calibrated (or read from the cache) now
                    self.member_weights(kind)
        return self

    def _place_on_ray(self) -> list:
        """Each member in a Ray actor (members/remote.py): the actors fetch and load the models
        where they run; this process gets only the tokenizers, from them."""
        from .members.remote import place_members

        return place_members([s.ref for s in self.sources], self.model_names, ray_address=self.ray_address,
                             member_resources=self.member_resources, dtype=self.dtypes[0], cache_dir=self.cache_dir,
                             trust_remote_code=self.trust_remote_code)

    @property
    def context_window(self) -> int:
        """The smallest member's context window, read from the model configs (no weights load)."""
        if self._members is not None or self.placement == "ray":  # ray: the actors read the configs
            return min(m.context_window for m in self.members)
        from transformers import AutoConfig

        sizes = []
        for s in self.sources:
            path = local_dir(s, self.cache_dir, progress=self.progress)
            cfg = AutoConfig.from_pretrained(path, trust_remote_code=self.trust_remote_code)
            cfg = cfg.get_text_config(decoder=True)
            sizes.append(int(getattr(cfg, "max_position_embeddings", None) or 2048))
        return min(sizes)

    def member_weights(self, kind: str = "chat") -> tuple[list[float], int]:
        """(member weights, main member) for requests of `kind` ("chat" or "raw").

        Weights: the method config's list; uniform for None; for "auto", the mixture weights that
        best explain a bundled calibration sample in that prompt kind (`calibrate.py`; measured
        once per member and cached on disk). The main member (drafter / primary) is the config's,
        else the one with the largest weight, else (uniform weights) the one with the most
        parameters."""
        members, method = self.load()._members, self._method
        given = method.member_weights()
        if isinstance(given, str) and given == "auto" and len(members) > 1:
            if kind not in self._auto:
                from .calibrate import Calibrator

                keys = [f"{s.ref}|{json.dumps(p, sort_keys=True)}|{m.dtype}" for s, p, m in
                        zip(self.sources, self.preambles, members)]
                self._auto[kind] = Calibrator(self.cache_dir).weights(members, keys, kind, self._chat_prompt)
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

    def _chat_prompt(self, i: int, question: str) -> str:
        """Member i's prompt text for one user message (its preamble, its chat format)."""
        msgs = with_preamble(self.member_preamble(i), [{"role": "user", "content": question}])
        return self.members[i].render_chat(msgs)

    def member_preamble(self, i: int) -> list[dict]:
        """The turns put before every chat request for member i: its own preamble when one was
        given, else the built-in one for a model without a chat template (a base model), else none."""
        if self.preambles[i] is not None:
            return self.preambles[i]
        return list(BASE_PREAMBLE) if not self.members[i].has_chat_template else []

    def __repr__(self) -> str:
        return f"Ensemble(members={self.model_names}, method={self.method_name!r})"

    # ---- public API ----------------------------------------------------------------------
    def generate(self, prompt: str | list[dict], params: GenerationParams | None = None, *,
                 max_new_tokens: int = UNSET, temperature: float = UNSET, top_p: float = UNSET, seed: int | None = UNSET,
                 stop: str | Sequence[str] | None = UNSET, raw: bool = UNSET, tools: Sequence[dict] | None = UNSET,
                 tool_choice: Any = UNSET, response_format: Any = UNSET, timeout: float | None = UNSET,
                 max_retries: int = UNSET, trace: bool = UNSET) -> GenerationResult:
        """Run one request to the end. `prompt`: a string (chat: one user turn; raw=True: the
        text as is) or a list of {'role', 'content'} messages. Settings: `params`
        (GenerationParams) and/or the same names as keywords (keywords win); see
        GenerationParams for each. With tools, `result.tool_calls` holds the parsed calls and
        `result.text` the rest."""
        job = self._job(prompt, params, _given(locals()))
        job.shows_text = False  # nobody sees the deltas: a fault after some text can still be retried
        stream = self._open(job)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, prompt: str | list[dict], params: GenerationParams | None = None, *,
               max_new_tokens: int = UNSET, temperature: float = UNSET, top_p: float = UNSET, seed: int | None = UNSET,
               stop: str | Sequence[str] | None = UNSET, raw: bool = UNSET, tools: Sequence[dict] | None = UNSET,
               tool_choice: Any = UNSET, response_format: Any = UNSET, timeout: float | None = UNSET,
               max_retries: int = UNSET, trace: bool = UNSET) -> TextStream:
        """Text deltas as they are decided; the stream's `.result` holds usage and stats at the end."""
        return self._open(self._job(prompt, params, _given(locals())))

    def _open(self, job: _Job) -> TextStream:
        items: "queue.Queue" = queue.Queue()
        cancel = threading.Event()
        self._submit(job, lambda kind, payload: items.put((kind, payload)), cancel)
        return TextStream(items, cancel)

    async def agenerate(self, prompt: str | list[dict], params: GenerationParams | None = None, *,
                        max_new_tokens: int = UNSET, temperature: float = UNSET, top_p: float = UNSET,
                        seed: int | None = UNSET, stop: str | Sequence[str] | None = UNSET, raw: bool = UNSET,
                        tools: Sequence[dict] | None = UNSET, tool_choice: Any = UNSET, response_format: Any = UNSET,
                        timeout: float | None = UNSET, max_retries: int = UNSET, trace: bool = UNSET) -> GenerationResult:
        """`generate` for asyncio: never blocks the event loop."""
        job = self._job(prompt, params, _given(locals()))
        job.shows_text = False
        stream = self._aopen(job)
        async for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def astream(self, prompt: str | list[dict], params: GenerationParams | None = None, *,
                max_new_tokens: int = UNSET, temperature: float = UNSET, top_p: float = UNSET, seed: int | None = UNSET,
                stop: str | Sequence[str] | None = UNSET, raw: bool = UNSET, tools: Sequence[dict] | None = UNSET,
                tool_choice: Any = UNSET, response_format: Any = UNSET, timeout: float | None = UNSET,
                max_retries: int = UNSET, trace: bool = UNSET) -> AsyncTextStream:
        """`stream` for asyncio: `async for delta in engine.astream(...)`."""
        return self._aopen(self._job(prompt, params, _given(locals())))

    def _aopen(self, job: _Job) -> AsyncTextStream:
        loop = asyncio.get_running_loop()
        items: "asyncio.Queue" = asyncio.Queue()
        cancel = threading.Event()

        def sink(kind, payload):
            try:
                loop.call_soon_threadsafe(items.put_nowait, (kind, payload))
            except RuntimeError:  # the caller's loop is gone: nobody is listening any more
                cancel.set()

        self._submit(job, sink, cancel)
        return AsyncTextStream(items, cancel)

    # ---- validation ----------------------------------------------------------------------
    def check_request(self, prompt: str | list[dict], params: GenerationParams | None = None,
                      **settings: Any) -> GenerationParams:
        """Validate a request exactly as generate/stream would, without loading or queueing
        anything: a bad argument raises RequestError naming it and the fix. Returns the
        settings as one GenerationParams."""
        return self._job(prompt, params, settings).params

    def _job(self, prompt: Any, params: GenerationParams | None, settings: dict[str, Any]) -> _Job:
        unknown = sorted(set(settings) - set(PARAM_FIELDS))
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {unknown}; the settings are {list(PARAM_FIELDS)}")
        if params is not None and not isinstance(params, GenerationParams):
            raise RequestError(f"params must be a GenerationParams, got {type(params).__name__}")
        if isinstance(settings.get("stop"), str):
            settings["stop"] = (settings["stop"],)
        if isinstance(settings.get("tools"), list):
            settings["tools"] = tuple(settings["tools"])
        params = (params or GenerationParams()).replace(**settings) if settings else (params or GenerationParams())
        prompt = _check_prompt(prompt, params.raw)
        self.method_class.check_request(self.config, temperature=params.temperature, top_p=params.top_p)
        return _Job(prompt, params)

    # ---- the worker ----------------------------------------------------------------------
    def _submit(self, job: _Job, sink: Callable, cancel: threading.Event) -> None:
        with self._worker_lock:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work, name="ensemble-llm-worker", daemon=True)
                self._worker.start()
        self._jobs.put((job, sink, cancel))

    def _work(self) -> None:
        while True:
            job, sink, cancel = self._jobs.get()
            if cancel.is_set():
                continue
            try:
                sink("done", self._attempts(job, sink, cancel))
            except EnsembleError as exc:
                sink("error", exc)

    def _attempts(self, job: _Job, sink: Callable, cancel: threading.Event) -> GenerationResult:
        """Run the request; an internal fault (GenerationError) is retried up to
        `max_retries` times under the same deadline, unless a stream already showed text."""
        sent = [False]

        def emit(delta: str) -> None:
            sent[0] = True
            sink("delta", delta)

        def guard() -> None:  # before every forward pass of this request
            if cancel.is_set():
                raise RequestCancelled("the caller stopped listening; the request was stopped.")
            job.check_deadline()

        retries = job.params.max_retries
        for attempt in range(retries + 1):
            try:
                job.check_deadline()  # it may have expired while waiting in the queue
                self.load()  # loading and calibration run once, outside the guard, so a short timeout
                with forward_guard(guard):  # cannot cut them off midway and make every request redo them
                    result = self._execute(job, emit, cancel)
                if attempt:
                    result.stats["retries"] = attempt
                return result
            except GenerationError as exc:  # a fault inside generation (e.g. a member's Ray actor died)
                if (sent[0] and job.shows_text) or attempt == retries:
                    if attempt:
                        raise GenerationError(f"{exc} (after {attempt} retries)") from exc
                    raise
            except EnsembleError:
                raise
            except Exception as exc:  # noqa: BLE001 - surfaced to the caller, the worker lives on
                err = GenerationError(f"generation failed: {type(exc).__name__}: {exc}"
                                      + (f" (after {attempt} retries)" if attempt else ""))
                err.__cause__ = exc
                if (sent[0] and job.shows_text) or attempt == retries:
                    raise err from exc
        raise AssertionError("unreachable")

    # ---- one request: a pipeline of named steps --------------------------------------------------
    def _execute(self, job: _Job, emit: Callable[[str], None], cancel: threading.Event) -> GenerationResult:
        t0 = time.perf_counter()
        before = [m.counters() for m in self.members]
        out, choice, retried = _Output(emit, t0), job.params.tool_choice, None
        while True:
            texts, stops = self._prompts(job, choice)
            weights, main = self.member_weights("raw" if job.params.raw else "chat")
            job.check_deadline()  # calibrating may have used it up
            run = self._run(job, texts, stops, weights, main, out, cancel)
            weights, main = run.req.weights, run.req.main  # this request's own (evidence.py)
            calls, again = self._tool_policy(job, run, choice)
            if not again:
                break
            choice, retried = "none", run  # only a repeated call was written: answer again without tools
        result = self._result(job, run, calls, texts[main], weights, main, before, out)
        if retried is not None:
            result.stats["answered_without_tools_after_repeated_call"] = True
            result.stats["repeated_tool_calls_dropped"] = retried.notes["repeated_tool_calls_dropped"]
        return result

    def _prompts(self, job: _Job, tool_choice: str) -> tuple[list[str], list[str]]:
        """Each member's prompt text (its own chat template or plain transcript) and the stops."""
        texts, stops = [], list(job.params.stop)
        tools = list(job.params.tools) if job.params.tools else None
        for i, m in enumerate(self.members):
            if job.params.raw:
                texts.append(job.prompt)
                continue
            msgs = [{"role": "user", "content": job.prompt}] if isinstance(job.prompt, str) else job.prompt
            msgs = with_preamble(self.member_preamble(i), msgs)
            msgs, member_tools = member_messages(m, msgs, tools, tool_choice)
            texts.append(m.render_chat(msgs, tools=member_tools))
            stops += [s for s in m.chat_stop_strings if s not in stops]
        return [t + job.head for t in texts], stops

    def _run(self, job: _Job, texts: list[str], stops: list[str], weights: list[float], main: int, out: "_Output",
             cancel: threading.Event) -> "_Run":
        """The method's run on every member's prompt, under the request's deadline, its text
        passed through the stop matcher and the tool-markup filter to the caller."""
        p, members = job.params, self.members
        prompt_ids = [m.prompt_ids(t) for m, t in zip(members, texts)]
        room = []
        for m, ids in zip(members, prompt_ids):
            if len(ids) >= m.context_window:
                raise RequestError(f"the prompt is {len(ids)} tokens for {m.name}, whose context window is "
                                   f"{m.context_window}; shorten the prompt or drop that member.")
            room.append(m.context_window - len(ids))
        run_notes: dict[str, Any] = {}
        weights, main = self._request_weights(job, texts, prompt_ids, weights, main, run_notes)
        generator = torch.Generator()
        generator.manual_seed(p.seed if p.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        req = Request(prompt_ids, min(p.max_new_tokens, *room), p.temperature, p.top_p, generator, stop=list(stops),
                      weights=weights, main=main, guide=Guide(p.constraint, members) if p.constraint else None,
                      trace=[] if p.trace else None)
        # holds back tool-call markup and passes content through; with tool_choice "none" a call
        # the model writes anyway (imitating its history) is cut from the content, not returned
        run = _Run(req, ToolTextFilter(list(p.tools) if p.tools else None), notes=run_notes)
        matcher = StopMatcher(stops)
        if job.head:  # the reply's fixed start, given at the end of the prompts
            out.send(run.filter.feed(job.head))
        gen = self._method.run(req)
        try:
            for piece in gen:
                job.check_deadline()
                out.send(run.filter.feed(matcher.feed(piece)))
                if matcher.stopped or cancel.is_set():
                    req.finish_reason = "stop"
                    break
        finally:
            gen.close()
        out.send(run.filter.feed(matcher.flush()))
        run.tail, run.text, run.calls = run.filter.finish()
        out.send(run.tail)
        return run

    def _request_weights(self, job: _Job, texts: list[str], prompt_ids: list[list[int]], prior: list[float],
                         main: int, notes: dict[str, Any]) -> tuple[list[float], int]:
        """With weights="auto", this request's member weights and main member: the calibrated
        prior updated by how well each member explains the answers the prompt already shows
        (evidence.py; scored in the prompt's own prefill). Other weight settings, one member, a
        prompt that shows no answer: the given weights and main member, unchanged."""
        method, members = self._method, self.members
        given = method.member_weights()
        if not (isinstance(given, str) and given == "auto") or len(members) < 2 or method.name == "single":
            return prior, main
        answers = [] if job.params.raw or isinstance(job.prompt, str) else [
            content_text(m.get("content")) for m in job.prompt if m.get("role") == "assistant"]
        plans = []
        for m, text, ids in zip(members, texts, prompt_ids):
            spans = answer_spans(text) if job.params.raw else chat_spans(text, answers)
            positions = answer_positions(m, text, ids, spans)
            if not positions:
                return prior, main
            plans.append((positions, len(spans)))
        # each shown answer is one observation of a member's competence: the mean log-prob per answer
        evidence = [float(sum(m.score_prompt(ids, pos))) / n for m, ids, (pos, n) in zip(members, prompt_ids, plans)]
        weights = posterior(prior, evidence)
        given_main = method.main_member()
        main = given_main if given_main is not None else max(range(len(members)), key=lambda i: (weights[i], -i))
        notes["evidence"] = {m.name: round(e, 3) for m, e in zip(members, evidence)}
        notes["evidence_positions"] = {m.name: len(p) for m, (p, _) in zip(members, plans)}
        return weights, main

    @staticmethod
    def _tool_policy(job: _Job, run: "_Run", tool_choice: str) -> tuple[list[ToolCall], bool]:
        """The calls to return, and whether to answer again without tools. With tool_choice
        "none" a call is dropped. With "auto", a call identical to one the conversation already
        made is dropped: small models imitate their history, and an agent would loop on it; when
        nothing else is left, the request is answered again without tools (same deadline)."""
        calls, stats = run.calls, run.notes
        if calls and tool_choice == "none":
            stats["ignored_tool_calls"], calls = len(calls), []
        if calls and tool_choice == "auto":
            seen = history_calls(job.prompt)
            fresh = [c for c in calls if call_key(c.name, c.arguments) not in seen]
            if len(fresh) < len(calls):
                stats["repeated_tool_calls_dropped"], calls = len(calls) - len(fresh), fresh
                if not calls and not run.text.strip():
                    return [], True
        return calls, False

    def _result(self, job: _Job, run: "_Run", calls: list[ToolCall], main_prompt: str, weights: list[float],
                main: int, before: list[tuple[int, float, int, int, int]], out: "_Output") -> GenerationResult:
        members, req = self.members, run.req
        stats = {**req.stats.to_dict(), **run.notes}
        raw_text = run.filter.text
        written = raw_text.removeprefix(job.head)  # the head was in the prompt, not generated
        usage = Usage(len(members[main].prompt_ids(main_prompt)), len(members[main].encode(written)) if written else 0)
        stats["members"] = {}
        moved = 0
        for m, (n0, t0, p0, b0, r0) in zip(members, before):
            n, t, p, b, r = m.counters()
            stats["members"][m.name] = {"forward_passes": n - n0, "forward_time_s": round(t - t0, 4),
                                        "prefills": p - p0}
            if self.placement == "ray":  # payload bytes to and from the member's actor, waits for its answers
                stats["members"][m.name].update(bytes_moved=b - b0, round_trips=r - r0)
                moved += b - b0
        if self.placement == "ray":
            stats["bytes_moved"] = moved
            stats["bytes_moved_per_token"] = round(moved / max(1, req.stats.tokens_out), 1)
        if len(members) > 1 and self._method.name != "single":
            stats["member_weights"] = {m.name: round(w, 4) for m, w in zip(members, weights)}
            stats["main_member"] = members[main].name
        if req.guide is not None:
            stats.update(req.guide.stats())
        if req.trace is not None:
            stats["trace"] = [_jsonable(e) for e in req.trace]
        stats["time_s"] = round(time.perf_counter() - out.t0, 4)
        stats["time_to_first_chunk_s"] = None if out.first is None else round(out.first, 4)
        finish = "tool_calls" if calls else req.finish_reason
        return GenerationResult(run.text, finish, usage, stats, self.method_name, self.model_names, calls, raw_text,
                                req.stats)
