"""`Ensemble` (floor 4): owns the members and one method; generate / stream / agenerate / astream.

Requests are checked before anything is queued (requests.py), run up to `max_batch` at once on
the worker's threads (worker.py; their member forwards share batched steps, their KV caches
within `kv_budget`: kvbudget.py) and reach their callers through a stream (streams.py). Each request is
a pipeline of named steps (pipeline.py): every member's prompt, this request's member weights
(evidence.py), the method's run under the stop matcher and the tool-markup filter, the tool
policy (tools.py), and the result with its usage and stats. A failed request raises in its
caller and leaves the engine usable.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence, Unpack

from .calibrate import EngineWeights
from .chat import BASE_PREAMBLE, render_chat, with_preamble
from .defaults import method_for
from .errors import ConfigError
from .kvbudget import KVBudget
from .members import DEFAULT_MODELS, Member
from .members.loader import config_window, load_members, local_dir, release_members
from .members.plan import MemoryPlan, plan_members
from .members.scheduler import StepScheduler
from .methods import get_method
from .params import GenerationParams
from .pipeline import run_request
from .placement import plan_placement, resolve_max_batch
from .requests import Job, Settings, make_job, member_entries
from .results import GenerationResult
from .scoring import Scorer, ScoreResult, run_score
from .sharing import ENGINE_OPTIONS, SHARED_ENGINES
from .streams import AsyncTextStream, Output, TextStream, async_channel, sync_channel
from .worker import Worker

if TYPE_CHECKING:
    import torch

    from .methods import MethodConfig

__all__ = ["ENGINE_OPTIONS", "AsyncTextStream", "Ensemble", "GenerationResult", "TextStream"]


class Ensemble(Scorer):
    """Several causal LMs decoded together by one ensembling method.

    members: bundled names, local folders, local .gguf files, hub ids (downloaded once) or
        'org/repo:file.gguf' (default: the bundled SmolLM2 + Gemma-3-270M pair), or {"model": ...,
        "preamble": [...], "revision", "device_map", "max_memory", "offload_folder"} dicts; the main
        member (drafter) is the strongest unless the method config names one.
    method: "single", "unite", "safe", "specfuse", "smc", "auto" (default: "auto" for 2+ members: specfuse
        for raw prompts, safe for chat; else "single");
        config: the method's config dataclass or a dict.
    device: "auto" (CUDA when present, else CPU), a device, or one device per member.
    dtype: "auto" (bf16 on CUDA, fp32 on CPU) or a torch dtype / name.
    max_batch: requests run at once, their forwards batched per member ("auto": 8 CPU, 32 CUDA).
    kv_budget: KV-cache bytes the running requests may hold per device, others wait (kvbudget.py).
    Weights load on first use (or `load()`), once per process for the same model and device.
    """

    def __init__(
        self,
        members: Sequence[str | os.PathLike[str] | dict[str, Any]] | str | None = None,
        method: str | None = None,
        config: MethodConfig | dict[str, Any] | None = None,
        *,
        device: str | torch.device | Sequence[str | torch.device] = "auto",
        dtype: str | torch.dtype | Sequence[str | torch.dtype] = "auto",
        cache_dir: str | os.PathLike[str] | None = None,
        trust_remote_code: bool = False,
        progress: bool = True,
        placement: Literal["local", "ray"] = "local",
        ray_address: str | None = None,
        member_resources: dict[str, float] | Sequence[dict[str, float]] | None = None,
        max_batch: int | Literal["auto"] = "auto",
        kv_budget: int | float | str | None = "auto",
    ) -> None:
        if members is None:
            members = list(DEFAULT_MODELS)
        if isinstance(members, (str, os.PathLike, dict)):
            members = [members]
        members = list(members)
        if not members:
            raise ConfigError("members is empty; name at least one model, e.g. members=['smollm2-135m-instruct'].")
        self.sources, self.preambles, self.options = member_entries(members, placement)
        plan = plan_placement(placement, ray_address, member_resources, device, dtype, len(members))
        self.placement, self.ray_address, self.member_resources = plan.kind, plan.ray_address, plan.member_resources
        self.devices, self.dtypes = plan.devices, plan.dtypes
        if method is None:
            method = method_for(len(members))
        if not isinstance(method, str):
            raise ConfigError(f"method must be a method name (str), got {method!r}")
        self.method_name = method
        self.method_class = get_method(method)
        self.config = self.method_class.make_config(config)
        # member-count rules (>= 2 members, indices and weights per member) need no weights: check now
        self.method_class(self.sources, self.config).check_members()
        self.cache_dir, self.trust_remote_code, self.progress = cache_dir, bool(trust_remote_code), progress
        self._members, self._method = None, None  # list[Member] and the method, built by load()
        self._weights = EngineWeights(cache_dir, self.sources, self.preambles, self._chat_prompt)
        self._load_lock = threading.RLock()  # load() calibrates "auto" weights, which asks for the members
        self.max_batch = resolve_max_batch(max_batch, self.placement, self.devices)  # requests at once
        self.scheduler = StepScheduler()  # this engine's steps (members/scheduler.py), no other engine's
        self.kv_budget = KVBudget(kv_budget, self.scheduler.config.slack)  # requests wait while their KV would not fit
        self._worker = Worker(self._execute, self.load, self.max_batch, self.scheduler)

    @classmethod
    def shared(
        cls, members: Sequence[str] | None = None, method: str | None = None, config: Any = None, **kw
    ) -> "Ensemble":
        """The process-wide engine for these arguments: built once, then returned again, so many
        framework objects (LangChain and LlamaIndex facades alike) share loaded models and one
        request queue. Arguments are validated exactly as by the constructor."""
        return SHARED_ENGINES.get_or_add(cls(members, method, config, **kw))

    @classmethod
    def shared_or_given(
        cls, engine: Any, members: Sequence[str] | None, method: str | None, config: Any, owner: object, **kw
    ) -> tuple["Ensemble", Callable[[], None] | None]:
        """What the framework facades hold: (`engine`, None) when the caller passed one (it must be an
        Ensemble), else the process-wide engine for the other arguments (`shared`) and the call that
        ends `owner`'s hold on it (also run when `owner` is collected; the last to go closes it)."""
        if engine is None:
            engine = cls.shared(members, method, config, **kw)
            return engine, SHARED_ENGINES.hold_for(owner, engine)
        if not isinstance(engine, cls):
            raise ConfigError(f"engine must be an ensemble_llm.Ensemble, got {type(engine).__name__}")
        return engine, None

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
                kw = {"cache_dir": self.cache_dir, "trust_remote_code": self.trust_remote_code, "options": self.options}
                refs = [s.ref for s in self.sources]
                if self.placement == "ray":  # each member in a Ray actor that fetches and loads it (ray/)
                    from .ray import place_members

                    kw |= {"ray_address": self.ray_address, "member_resources": self.member_resources}
                    members = place_members(refs, self.model_names, dtype=self.dtypes[0], **kw)
                else:
                    self.plan().check()  # the whole set, before any member downloads or loads
                    # slots: a llama.cpp context holds max_batch requests; the loads overlap outside the GIL
                    members = load_members(
                        refs, self.devices, self.dtypes, progress=self.progress, slots=self.max_batch, **kw
                    )
                method = self.method_class(members, self.config)
                method.check_members()
                _ = [m.vocab_bytes for m in members]  # token byte tables read now, not in the first request
                self._members, self._method = members, method
                for kind in ("chat", "raw"):  # "auto" weights: calibrated (or read from the cache) now
                    self.member_weights(kind)
        return self

    def close(self) -> None:
        """Free the members (the next request loads them again); `with Ensemble(...) as engine:` calls it."""
        self._worker.wait_idle(5.0)  # a request that just answered: its thread lets go of the members
        self._worker.stop()
        with self._load_lock:
            members, self._members, self._method = self._members, None, None
        SHARED_ENGINES.drop(self)
        release_members(members or [])

    def __enter__(self) -> "Ensemble":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def plan(self, context_tokens: int | None = None) -> MemoryPlan:
        """Weights + KV per member and device, read from files (members/plan.py); load() checks it."""
        if self.placement == "ray":
            raise ConfigError("the memory plan covers placement='local'; each Ray actor checks its member's")
        return plan_members(
            self.sources, self.devices, self.dtypes, self.options, self.cache_dir, context_tokens, self.max_batch
        )

    @property
    def context_window(self) -> int:
        """The smallest member's context window, read from the model configs (no weights load)."""
        if self._members is not None or self.placement == "ray":  # ray: the actors read the configs
            return min(m.context_window for m in self.members)
        return min(
            config_window(
                local_dir(s, self.cache_dir, progress=self.progress, revision=o.revision), self.trust_remote_code
            )
            for s, o in zip(self.sources, self.options)
        )

    def member_weights(self, kind: str = "chat") -> tuple[list[float], int]:
        """(member weights, main member) for requests of `kind` ("chat" or "raw"): calibrate.py's
        `EngineWeights` (the config's weights, or "auto": calibrated once per kind)."""
        self.load()
        return self._weights.of(kind, self._members, self._method)

    def _chat_prompt(self, i: int, question: str) -> str:
        """Member i's prompt text for one user message (its preamble, its chat format)."""
        msgs = with_preamble(self.member_preamble(i), [{"role": "user", "content": question}])
        return render_chat(self.members[i], msgs)

    def member_preamble(self, i: int) -> list[dict]:
        """The turns put before every chat request for member i: its own preamble when one was
        given, else the built-in one for a model without a chat template (a base model), else none."""
        if self.preambles[i] is not None:
            return self.preambles[i]
        return list(BASE_PREAMBLE) if not self.members[i].has_chat_template else []

    def __repr__(self) -> str:
        return f"Ensemble(members={self.model_names}, method={self.method_name!r})"

    # ---- public API ----------------------------------------------------------------------
    # `prompt`: a string (chat: one user turn; raw=True: the text as is) or a list of {'role',
    # 'content'} messages. Settings: `params` (GenerationParams) and/or the same names as keywords
    # (`Settings`; keywords win). With tools, `result.tool_calls` holds the parsed calls and
    # `result.text` the rest.
    def generate(
        self, prompt: str | list[dict], params: GenerationParams | None = None, **settings: Unpack[Settings]
    ) -> GenerationResult:
        """Run one request to the end and return its result."""
        return self.generate_many([prompt], params, **settings)[0]

    def generate_many(
        self, prompts: Sequence[str | list[dict]], params: GenerationParams | None = None, **settings: Unpack[Settings]
    ) -> list[GenerationResult]:
        """Many requests at once (up to `max_batch` decode together, one batched forward per member
        per step), every prompt checked before any runs; results in order."""
        jobs = [self._job(p, params, settings) for p in prompts]
        for job in jobs:
            job.shows_text = False  # nobody sees the deltas: a fault after some text can still be retried
        streams = [self._open(job, sync_channel()) for job in jobs]
        for stream in streams:  # a failure is raised in order; the requests after it still finish
            for _ in stream:
                pass
        return [s.result for s in streams]

    def stream(
        self, prompt: str | list[dict], params: GenerationParams | None = None, **settings: Unpack[Settings]
    ) -> TextStream:
        """Text deltas as they are decided; the stream's `.result` holds usage and stats at the end."""
        return self._open(self._job(prompt, params, settings), sync_channel())

    async def agenerate(
        self, prompt: str | list[dict], params: GenerationParams | None = None, **settings: Unpack[Settings]
    ) -> GenerationResult:
        """`generate` for asyncio: never blocks the event loop."""
        job = self._job(prompt, params, settings)
        job.shows_text = False
        stream = self._open(job, async_channel())
        async for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def astream(
        self, prompt: str | list[dict], params: GenerationParams | None = None, **settings: Unpack[Settings]
    ) -> AsyncTextStream:
        """`stream` for asyncio: `async for delta in engine.astream(...)`."""
        return self._open(self._job(prompt, params, settings), async_channel())

    def _open(self, job: Job, channel) -> TextStream:
        sink, cancel, stream = channel
        self._worker.submit(job, sink, cancel)
        return stream

    def check_request(
        self, prompt: str | list[dict], params: GenerationParams | None = None, **settings: Unpack[Settings]
    ) -> GenerationParams:
        """Validate a request exactly as generate/stream would, without loading or queueing
        anything: a bad argument raises RequestError naming it and the fix. Returns the
        settings as one GenerationParams."""
        return self._job(prompt, params, settings).params

    def _job(self, prompt: Any, params: GenerationParams | None, settings: dict[str, Any]) -> Job:
        return make_job(prompt, params, dict(settings), self.method_class, self.config)

    # ---- one request: a pipeline of named steps (pipeline.py) -----------------------------------
    def _execute(
        self, job: Job, emit: Callable[[str], None], cancel: threading.Event
    ) -> GenerationResult | ScoreResult:
        if job.scoring is not None:
            return run_score(self, job)
        return run_request(self, self._method, job, Output(emit, time.perf_counter()), cancel)
