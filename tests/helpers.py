"""Helpers the tests share (import them from here, not from conftest)."""

from __future__ import annotations

import json
import os

SMOL = "smollm2-135m-instruct"
GEMMA = "gemma-3-270m"
# the bundled pair on transformers (a GGUF member's default is llama.cpp): for tests of transformers'
# own caches or of figures measured on its numerics
HF_PAIR = [{"model": SMOL, "backend": "transformers"}, {"model": GEMMA, "backend": "transformers"}]
# pydantic's schema of Node(name: str, child: Optional[Node]), child required: a recursive model
# whose shortest valid document needs more than a few tokens
NODE_SCHEMA = {
    "$defs": {
        "Node": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "child": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]},
            },
            "required": ["name", "child"],
        }
    },
    "$ref": "#/$defs/Node",
}


# every method on the tiny models, with uniform weights (and 2 particles for smc): (method, config)
TINY_METHODS = [
    ("single", None),
    ("unite", {"weights": None}),
    ("safe", {"weights": None}),
    ("specfuse", {"weights": None}),
    ("smc", {"weights": None, "n_particles": 2}),
]


def tiny_pair_for(method: str, tiny_dirs: dict) -> list[str]:
    """The tiny members a method runs on: SmolLM2's alone for single, else the SmolLM2 + Gemma pair."""
    return [tiny_dirs["smol"]] if method == "single" else [tiny_dirs["smol"], tiny_dirs["gemma"]]


def tiny_llama(vocab: int, ctx: int = 2048, layers: int = 2, hidden: int = 32, init: float = 0.02):
    """A tiny random-weight Llama for the SmolLM2 tokenizer (seed torch first for the same weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=ctx,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
        initializer_range=init,
    )
    return LlamaForCausalLM(cfg)


def tiny_gemma(vocab: int, ctx: int = 2048, layers: int = 2):
    """A tiny random-weight Gemma-3 for the Gemma tokenizer: sliding-window (8) and full layers."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        max_position_embeddings=ctx,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    return Gemma3ForCausalLM(cfg)


def greedy(member, prompt: str, n: int = 20) -> tuple[list[int], str]:
    """n greedy tokens after the prompt, one extend each: (ids, text)."""
    state = member.prefill(member.prompt_ids(prompt))
    out = []
    for _ in range(n):
        out.append(int(state.next_logprobs.argmax()))
        member.extend(state, [out[-1]])
    return out, member.decode(out)


def start_server(
    models: list[str],
    method: str,
    api_key: str | None = None,
    max_queue: int = 64,
    timeout: float = 240.0,
    extra: list[str] = (),
):
    """`ensemble-llm serve` in a real process on a free 127.0.0.1 port; returns (process, base URL)
    once /health answers. The caller terminates the process."""
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = (
        [
            sys.executable,
            "-m",
            "ensemble_llm",
            "serve",
            "--models",
            json.dumps(models) if any(isinstance(m, dict) for m in models) else ",".join(models),
            "--method",
            method,
            "--port",
            str(port),
            "--max-queue",
            str(max_queue),
        ]
        + (["--api-key", api_key] if api_key else [])
        + list(extra)
    )
    proc = subprocess.Popen(
        cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return proc, wait_healthy(proc, f"http://127.0.0.1:{port}", timeout, proc.stdout.read)


def wait_healthy(proc, base: str, timeout: float, output) -> str:
    """`base` once the server process answers /health; `output()` gives its output for the error
    when it exits first or does not come up in `timeout` seconds."""
    import time

    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited:\n" + output())
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return base
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"the server did not come up in {timeout:.0f} s:\n" + output())


def flat(scores) -> list[float]:
    """score_prompt's PromptScores as one list of numbers (log-prob, gap, ...) for pytest.approx."""
    return [x for s in scores for x in s]


# country names in Russian: SmolLM2 (English) is far from writing these answers, Gemma-3 near them
# demonyms: Gemma-3 copies the country at the query (its shot answers look fine), SmolLM2 does not
DEMONYM = "Q: Kenya\nA: Kenyan\nQ: Papua New Guinea\nA: Papua New Guinean\nQ: Dominica\nA: Dominican\nQ: Lithuania\nA:"
RUSSIAN = "Q: France\nA: Франция\nQ: Germany\nA: Германия\nQ: Italy\nA: Италия\nQ: Spain\nA: Испания\nQ: Japan\nA:"
