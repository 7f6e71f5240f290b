"""`serve`'s tokenizer endpoints, in vLLM's shapes, so that a client such as lm-evaluation-harness
(`tokenizer_backend=remote`) needs no tokenizer folder: GET /tokenizer_info, POST /tokenize and
POST /detokenize. They speak the tokenizer of the member that reads token-id prompts and reports
completions' log-probabilities (serve_scoring.reporting_member: the engine's main member for raw
prompts). Special tokens written in the text ("<|endoftext|>") are read as those tokens, as
Hugging Face tokenizers and vLLM read them: lm-eval finds the EOS id it prefixes to empty
contexts that way."""

from __future__ import annotations

from typing import Any

from .errors import RequestError
from .serve_scoring import reporting_member


def _token(member: Any, tid: int | None) -> str | None:
    return None if tid is None else member.decode([tid], skip_special_tokens=False)


def _bos_id(member: Any) -> int | None:
    ids = member.prompt_ids("a")
    return ids[0] if ids and ids[0] in member.special_ids and ids[1:] == member.encode("a") else None


def tokenizer_info(engine: Any) -> dict[str, Any]:
    """The reporting member's tokenizer: its special tokens, chat template and window."""
    member = reporting_member(engine, raw=True)
    tok = getattr(member, "tokenizer", None)
    pad = getattr(tok, "pad_token_id", None)
    return {
        "tokenizer_class": type(tok).__name__ if tok is not None else None,
        "model": member.name,
        "eos_token": _token(member, member.eos_id),
        "bos_token": _token(member, _bos_id(member)),
        "pad_token": _token(member, pad) if isinstance(pad, int) else None,
        "chat_template": getattr(tok, "chat_template", None),
        "model_max_length": member.context_window,
        "vocab_size": len(member.vocab_bytes),
    }


def tokenize(engine: Any, data: dict[str, Any]) -> dict[str, Any]:
    """POST /tokenize: {"prompt": text, "add_special_tokens": bool} -> {"tokens", "count", "max_model_len"}."""
    member = reporting_member(engine, raw=True)
    if "messages" in data:
        raise RequestError("/tokenize reads a prompt here, not messages; send {'prompt': text}")
    prompt, add = data.get("prompt"), data.get("add_special_tokens", True)
    if not isinstance(prompt, str):
        raise RequestError("/tokenize needs 'prompt', a string")
    if not isinstance(add, bool):
        raise RequestError("add_special_tokens must be true or false")
    ids = member.prompt_ids(prompt) if add else member.encode(prompt)
    out = {"tokens": [int(t) for t in ids], "count": len(ids), "max_model_len": member.context_window}
    if data.get("return_token_strs"):
        out["token_strs"] = [member.decode([t], skip_special_tokens=False) for t in ids]
    return out


def detokenize(engine: Any, data: dict[str, Any]) -> dict[str, Any]:
    """POST /detokenize: {"tokens": [ids]} -> {"prompt": text} (special tokens written out)."""
    member = reporting_member(engine, raw=True)
    ids = data.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RequestError("/detokenize needs 'tokens', a list of token ids")
    bad = [t for t in ids if not 0 <= t < len(member.vocab_bytes)]
    if bad:
        raise RequestError(
            f"token ids {bad[:5]} are outside {member.name}'s vocabulary (0..{len(member.vocab_bytes) - 1})"
        )
    return {"prompt": member.decode(ids, skip_special_tokens=False)}
