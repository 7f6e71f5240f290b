"""Connecting a server member: its tokenizer here, the server's figures, and a check that the two
tokenize alike (a server running another model than the member names is refused)."""

from __future__ import annotations

from pathlib import Path

from ....errors import ConfigError
from ...sources import GGUF_KINDS, Source, gguf_file
from ...view import TOKENIZER_SAMPLE
from .. import LoadRequest
from .client import ServerClient, ServerError
from .member import ServerMember

TOP_K = 20  # top log-probs asked per position: what vLLM and Ollama allow by default


def member_tokenizer(source: Source, cache_dir, progress) -> tuple:
    """(the model's own tokenizer, the folder it was cached in or None, the GGUF file's name or ""),
    read here: from its GGUF file (without the weights) or its folder."""
    from ...convert import load_cached_tokenizer
    from ...loader import gguf_tokenizer_folder, local_dir

    if source.kind in GGUF_KINDS:
        path = gguf_file(source, cache_dir, progress)
        folder = gguf_tokenizer_folder(source, path, cache_dir)
        return load_cached_tokenizer(folder), str(folder), path.name
    from transformers import AutoTokenizer

    folder = local_dir(source, cache_dir, progress=progress)
    return AutoTokenizer.from_pretrained(folder), None, ""


def server_info(client: ServerClient) -> dict:
    """n_vocab, n_ctx (one slot's context), n_params, from the server's /v1/models and /props."""
    try:
        models = client.get("/v1/models")
        props = client.get("/props")
    except ServerError as exc:
        raise ConfigError(f"{exc} (while connecting: is it a llama.cpp server, `llama-server`?)") from exc
    meta = ((models.get("data") or [{}])[0]).get("meta") or {}
    n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx") or meta.get("n_ctx_train")
    if not meta.get("n_vocab") or not n_ctx:
        raise ConfigError(
            f"the server at {client.url} does not say its vocabulary size and context (/v1/models meta, /props); "
            "backend='server' speaks llama.cpp's `llama-server` API."
        )
    path = str(props.get("model_path") or "")
    file = Path(path).name
    return {"n_vocab": int(meta["n_vocab"]), "n_ctx": int(n_ctx), "n_params": meta.get("n_params"), "model_file": file}


def check_tokenizer(member: ServerMember) -> None:
    for text in TOKENIZER_SAMPLE:
        theirs = member.client.post("/tokenize", {"content": text, "add_special": False})["tokens"]
        ours = member.encode(text)
        if theirs != ours:
            raise ConfigError(
                f"member {member.name!r}: the server at {member.url} tokenizes {text[:30]!r}... as {theirs[:12]}, "
                f"but {member.name}'s tokenizer gives {ours[:12]}: the server runs another model. Name the model "
                "the server runs (its bundled name, .gguf file or folder) as the member's model."
            )


def accepts(source: Source, options, cache_dir, progress: bool, named: bool) -> bool:
    """Only where named (the server loaded the model; `url` says where): never picked by "auto"."""
    if named and options.transformers_only:
        raise ConfigError(
            f"member {source.ref!r} runs on the server at {options.url}, so quantization and "
            "device_map/max_memory/offload_folder do not apply (the server loaded it); drop them."
        )
    return named


def load_server_member(req: LoadRequest) -> ServerMember:
    """A member on the llama.cpp server at `options.url`."""
    source, options = req.source, req.options
    tokenizer, folder, file = member_tokenizer(source, req.cache_dir, req.progress)
    client = ServerClient(source.name, options.url, options.timeout or 60.0)
    try:
        info = server_info(client)
        info["member_file"] = file
        member = ServerMember(source.name, client, tokenizer, info, top_k=TOP_K, source=options.url)
        member.tokenizer_folder = folder
        check_tokenizer(member)
    except BaseException:
        client.close()
        raise
    return member
