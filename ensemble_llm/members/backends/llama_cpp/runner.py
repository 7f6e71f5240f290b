"""llama.cpp through llama-cpp-python's low-level API: one model, one context, its sequences.

What a llama.cpp member (llama.py) needs of the binding, and nothing more:
- one context with a unified KV cache (`kv_unified`): every sequence's cells in one pool, so a
  sequence forks without a copy (`llama_memory_seq_cp` adds the new sequence id to the source's
  cells) and crops by `llama_memory_seq_rm`; sliding-window layers keep every cell (`swa_full`),
  so a sequence can be rolled back past the window;
- `decode`: one `llama_decode` over any tokens of any sequences, each at its own position, with
  logits only where asked (chunked by the context's batch size);
- sequence ids from a pool (`Seq` handles): a handle nobody holds any more gives its id back and
  its cells are freed before the next decode (never from inside another thread's decode).

Why not `llama_cpp.Llama`: it holds one sequence at a time; batching several requests' steps,
forking candidates and trees needs the sequences themselves (the high-level API's own batched
server is a separate program).

Measured here: a step's logits for a sequence are those of the same tokens decoded alone when
its cells sit in the same order (0.0 difference, wherever in the pool they sit); llama.cpp's
attention sums over a sequence's cells in the order they sit in the pool, and a token that lands
in a freed cell before the sequence's earlier ones moved the log-probs visibly (through the
int8-quantized activations); a decode's kernels also depend on how many rows it holds. So
results depend on what else the cache held and holds: llama.py keeps stored prompts outside the
context and runs prompts in aligned pieces, so that a request run alone repeats.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import weakref
from collections import deque
from typing import Sequence

import numpy as np

from ....errors import ConfigError, GenerationError

MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ: sequence ids per context
_INIT = threading.Lock()
_BACKEND_READY = False


def binding():
    """The llama_cpp module, or a ConfigError that says how to install it."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise ConfigError(
            "this member runs on llama.cpp, which needs llama-cpp-python: pip install 'llama-cpp-python>=0.3.16' "
            "(or give the member backend='transformers')."
        ) from exc
    return llama_cpp


class Seq:
    """A sequence id of a context, held by a state, a fork, a stored prompt or a tree node. When the
    handle is dropped, the id goes back to its pool (its cells are freed at the next decode)."""

    __slots__ = ("id", "__weakref__")

    def __init__(self, pool: "SeqPool", sid: int) -> None:
        self.id = sid
        weakref.finalize(self, pool.release, sid)


class SeqPool:
    """The sequence ids of one context. `release` may run in any thread (a handle's finalizer):
    it only queues the id; `flush` frees the queued ids' cells, under the context's lock."""

    def __init__(self, runner: "LlamaRunner", size: int) -> None:
        self.runner = runner
        self._free = list(range(size - 1, -1, -1))
        self._dead: deque[int] = deque()

    def release(self, sid: int) -> None:
        self._dead.append(sid)

    def flush(self) -> None:
        while self._dead:
            sid = self._dead.popleft()
            self.runner.seq_rm(sid, -1, -1)
            self._free.append(sid)

    def take(self) -> Seq:
        if not self._free:
            import gc

            gc.collect()  # handles in reference cycles (smc's trees) give their ids back
            self.flush()
        if not self._free:
            raise GenerationError(
                f"llama.cpp sequences exhausted ({MAX_SEQ} per member): too many requests, candidates or "
                "smc hypotheses at once; lower max_batch or smc's n_particles / beam_width."
            )
        return Seq(self, self._free.pop())

    @property
    def in_use(self) -> int:
        return MAX_SEQ - len(self._free) - len(self._dead)


class LlamaRunner:
    """One GGUF model and one context (see the module). Not thread-safe: its member's lock
    serializes every call."""

    def __init__(
        self, path: str, n_ctx: int, n_threads: int, n_gpu_layers: int, n_batch: int = 512, extra_bufts: bool = True
    ) -> None:
        """`extra_bufts`: llama.cpp's extra buffer types (AMX, repacked weights), where the health
        check (health.py) found this CPU survives them."""
        lib = binding()
        self.lib = lib
        global _BACKEND_READY
        with _INIT:
            if not _BACKEND_READY:
                lib.llama_log_set(_quiet_log(lib), ctypes.c_void_p(0))
                lib.llama_backend_init()
                _BACKEND_READY = True
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers, mp.use_extra_bufts = n_gpu_layers, extra_bufts
        self.extra_bufts = extra_bufts
        self.model = lib.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            why = _load_error(lib, path, mp)
            raise ConfigError(
                f"llama.cpp could not load {path}{f' ({why})' if why else ''}; check that it is a complete GGUF file."
            )
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(lib.llama_model_n_ctx_train(self.model))
        cp = lib.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_batch, MAX_SEQ
        cp.n_threads = cp.n_threads_batch = n_threads
        cp.kv_unified, cp.swa_full, cp.no_perf = True, True, True
        self.ctx = lib.llama_init_from_model(self.model, cp)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise ConfigError(
                f"llama.cpp could not make a context of {n_ctx} tokens for {path} (out of memory?); lower kv_budget "
                "or max_batch."
            )
        self.n_ctx, self.n_batch = int(lib.llama_n_ctx(self.ctx)), n_batch
        self.mem = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(n_batch, 0, 1)
        self._token = np.ctypeslib.as_array(self.batch.token, shape=(n_batch,))
        self._pos = np.ctypeslib.as_array(self.batch.pos, shape=(n_batch,))
        self._nseq = np.ctypeslib.as_array(self.batch.n_seq_id, shape=(n_batch,))
        self._logits = np.ctypeslib.as_array(self.batch.logits, shape=(n_batch,))
        self._seq_rows = [self.batch.seq_id[i] for i in range(n_batch)]
        self.seqs = SeqPool(self, MAX_SEQ)
        self.decodes = 0  # llama_decode calls (figures)
        self.n_threads = n_threads

    def set_threads(self, n: int) -> None:
        """The threads the next decodes use (llama.cpp takes a new count at any decode)."""
        if n != self.n_threads:
            self.lib.llama_set_n_threads(self.ctx, n, n)
            self.n_threads = n

    def close(self) -> None:
        lib = self.lib
        if getattr(self, "ctx", None):
            lib.llama_batch_free(self.batch)
            lib.llama_free(self.ctx)
            lib.llama_model_free(self.model)
            self.ctx = self.model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the library may be gone
            pass

    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        self.lib.llama_memory_seq_rm(self.mem, seq, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self.lib.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def save(self, seq: int) -> bytes:
        """A sequence's cells (every layer's keys and values, with their positions) as bytes."""
        self.seqs.flush()
        size = self.lib.llama_state_seq_get_size(self.ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        done = self.lib.llama_state_seq_get_data(self.ctx, buf, size, seq)
        return bytes(buf)[:done]

    def restore(self, seq: int, data: bytes, n: int) -> bool:
        """An empty sequence from `save`d cells, kept up to position n; False when the context had
        no room for them (the sequence stays empty)."""
        self.seqs.flush()
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if self.lib.llama_state_seq_set_data(self.ctx, buf, len(data), seq) == 0:
            self.seq_rm(seq, -1, -1)
            return False
        self.seq_rm(seq, n, -1)
        return True

    def decode(
        self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int], wants: Sequence[bool]
    ) -> np.ndarray:
        """One decode of these tokens (token i of sequence seqs[i] at positions[i]), in chunks of the
        batch size: the logits [outputs, V] (float32) of the tokens with wants[i], in order."""
        self.seqs.flush()
        out, n = [], len(tokens)
        for start in range(0, n, self.n_batch):
            end = min(n, start + self.n_batch)
            k = end - start
            self._token[:k] = tokens[start:end]
            self._pos[:k] = positions[start:end]
            self._nseq[:k] = 1
            self._logits[:k] = wants[start:end]
            for i in range(k):
                self._seq_rows[i][0] = seqs[start + i]
            self.batch.n_tokens = k
            rc = self.lib.llama_decode(self.ctx, self.batch)
            self.decodes += 1
            if rc != 0:
                raise self._decode_error(rc, k)
            m = int(sum(wants[start:end]))
            if m:
                ptr = self.lib.llama_get_logits(self.ctx)
                out.append(np.ctypeslib.as_array(ptr, shape=(m, self.n_vocab)).copy())
        if not out:
            return np.zeros((0, self.n_vocab), dtype=np.float32)
        return out[0] if len(out) == 1 else np.concatenate(out)

    def _decode_error(self, rc: int, k: int) -> Exception:
        if rc == 1:
            return KVFull(
                f"llama.cpp's KV cache ({self.n_ctx} tokens) has no room for {k} more; lower max_batch or "
                "max_new_tokens, or raise kv_budget."
            )
        return GenerationError(f"llama_decode failed (code {rc}) on a batch of {k} tokens")


class KVFull(GenerationError):
    """The context has no free cells for a decode (its member frees stored prompts and retries)."""


_LOG = []  # the callback handed to llama.cpp (kept alive here for the process: its log is process-wide)


def _quiet_log(lib):
    """llama.cpp's log callback: a C function that ignores its arguments (libc's `abs`, which
    reads one int and touches nothing), so the log lines (one per tensor: over a thousand for
    Gemma-3) never wait for Python's lock: a Python callback slowed Gemma's model open several
    times while another thread ran Python (the pair's loads do). A failed load is
    opened again with `_ErrorLines` to say why. Without a C library to take it from, a Python
    callback that writes the error lines to stderr."""
    if not _LOG:
        try:
            _LOG.append(ctypes.cast(ctypes.CDLL(None).abs, lib.llama_log_callback))
        except (OSError, AttributeError, TypeError):  # no libc handle here (Windows)
            _LOG.append(_ErrorLines(lib, sys.stderr.write).callback)
    return _LOG[0]


class _ErrorLines:
    """A Python log callback that hands llama.cpp's error lines to `sink` (by default: keeps them in `lines`)."""

    def __init__(self, lib, sink=None) -> None:
        self.lines: list[str] = []
        keep = sink or (lambda text: self.lines.append(text.strip()))

        def log(level, text, user_data):
            if level == 4:  # GGML_LOG_LEVEL_ERROR
                keep(text.decode("utf-8", errors="replace"))

        self.callback = lib.llama_log_callback(log)


def _load_error(lib, path: str, params) -> str:
    """Why llama.cpp cannot load `path`: its error lines from opening it once more with them kept."""
    errors = _ErrorLines(lib)
    with _INIT:
        lib.llama_log_set(errors.callback, ctypes.c_void_p(0))
        try:
            model = lib.llama_model_load_from_file(path.encode(), params)
            if model:
                lib.llama_model_free(model)
        finally:
            lib.llama_log_set(_quiet_log(lib), ctypes.c_void_p(0))
    return " ".join(line for line in errors.lines if line)
