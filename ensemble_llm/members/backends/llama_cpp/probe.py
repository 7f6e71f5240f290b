"""The child side of the llama.cpp health check (health.py). Run as a script, never imported
by the package: a crash here (SIGSEGV, SIGILL) ends this child, not the process that asked.

Usage: python probe.py MODEL.gguf EXTRA_BUFTS(0|1)

It loads the model on the CPU with or without llama.cpp's extra buffer types (AMX tiles and
repacked weights), decodes a batch of tokens (the matrix-matrix kernels a prompt takes) and then
single tokens (the matrix-vector kernels of a decode step), and prints "ok" when every logit is
finite. Exit 0: the configuration works on this CPU and build.
"""

from __future__ import annotations

import math
import os
import signal
import sys

FAULT_ENV = "ENSEMBLE_LLM_PROBE_FAULT"  # test-only: "all" or "extra" makes the matching probes crash
BATCH = 32  # one prompt-sized decode; then STEPS one-token decodes
STEPS = 4


def fault(extra: bool) -> None:
    """The injected crash of the tests: a real SIGSEGV, as the faulting kernel would raise."""
    which = os.environ.get(FAULT_ENV, "")
    if which == "all" or (which == "extra" and extra):
        os.kill(os.getpid(), signal.SIGSEGV)


def decode(lib, ctx, batch, tokens: list[int], start: int, n_vocab: int) -> bool:
    """One decode of `tokens` at positions start.. of sequence 0; whether the last logits are finite."""
    for i, tok in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, start + i, 1
        batch.seq_id[i][0], batch.logits[i] = 0, i == len(tokens) - 1
    batch.n_tokens = len(tokens)
    if lib.llama_decode(ctx, batch) != 0:
        return False
    row = lib.llama_get_logits_ith(ctx, -1)
    return all(math.isfinite(row[j]) for j in range(0, n_vocab, max(1, n_vocab // 997)))


def main(argv: list[str]) -> int:
    path, extra = argv[1], argv[2] == "1"
    fault(extra)
    import llama_cpp as lib

    lib.llama_backend_init()
    mp = lib.llama_model_default_params()
    mp.n_gpu_layers, mp.use_extra_bufts = 0, extra
    model = lib.llama_model_load_from_file(path.encode(), mp)
    if not model:
        print(f"llama.cpp could not load {path}", file=sys.stderr)
        return 3  # health.LOAD_FAILED: the file's fault, not the CPU's
    cp = lib.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = 256, BATCH, BATCH
    ctx = lib.llama_init_from_model(model, cp)
    n_vocab = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model)))
    batch = lib.llama_batch_init(BATCH, 0, 1)
    tokens = [(97 + 31 * i) % n_vocab for i in range(BATCH + STEPS)]
    ok = decode(lib, ctx, batch, tokens[:BATCH], 0, n_vocab)
    for i in range(STEPS):
        ok = ok and decode(lib, ctx, batch, [tokens[BATCH + i]], BATCH + i, n_vocab)
    lib.llama_batch_free(batch)
    lib.llama_free(ctx)
    lib.llama_model_free(model)
    if not ok:
        print("llama.cpp decoded, but its logits were not finite", file=sys.stderr)
        return 4
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
