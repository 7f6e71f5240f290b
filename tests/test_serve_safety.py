"""`ensemble-llm serve` in front of users (issue 47), each case through a real server process on
127.0.0.1 with tiny random-weight members and the real tokenizers: bounded work per request
(schemas, counts, body size, checks off the event loop under a time bound), browsers kept out
(415, 421, CORS closed, the key from the environment or a file, /metrics behind it, /docs off,
404 for a model not served), nothing leaked (500s and stream errors: a generic message and a
request id, the detail in the server's log), one bad call never failing the others of its batched
step, queue slots and client streams released on every path."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
from helpers import NODE_SCHEMA, wait_healthy

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytestmark = pytest.mark.server

KEY = "safety-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HELLO = [{"role": "user", "content": "hi"}]


def doubling(levels: int) -> dict:
    """`levels` chained definitions, each referring twice to the next: about 2 KB at 16 levels,
    whose $refs inlined would make 2**levels copies of the last one."""
    defs = {
        f"d{i}": {
            "type": "object",
            "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}, "b": {"$ref": f"#/$defs/d{i + 1}"}},
            "required": ["a", "b"],
        }
        for i in range(levels)
    }
    defs[f"d{levels}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def serve(args: list[str], log: Path, env: dict | None = None, launcher: Path | None = None, timeout: float = 240):
    """`ensemble-llm serve ARGS` (or `python LAUNCHER ARGS`, which calls the same CLI) on a free
    port, its output in `log`; (process, base URL) once /health answers."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    entry = [str(launcher)] if launcher else ["-m", "ensemble_llm"]
    cmd = [sys.executable, *entry, "serve", "--port", str(port), *args]
    out = open(log, "w")
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, stdout=out, stderr=out)
    return proc, wait_healthy(proc, f"http://127.0.0.1:{port}", timeout, log.read_text)


def stop(proc) -> None:
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tiny_dirs, tmp_path_factory):
    """The pair under safe, the key from ENSEMBLE_LLM_API_KEY (no argv), a 1 s bound on checks."""
    log = tmp_path_factory.mktemp("safety") / "server.log"
    members = ",".join([tiny_dirs["smol"], tiny_dirs["gemma"]])
    args = ["--models", members, "--method", "safe", "--max-queue", "4", "--check-timeout", "1"]
    proc, base = serve(args, log, env={"ENSEMBLE_LLM_API_KEY": KEY})
    yield base
    stop(proc)


def post(base: str, body: dict | None = None, *, headers: dict | None = None, content: bytes | None = None, **kw):
    """A chat completion over plain HTTP, with the key and a JSON body unless told otherwise."""
    hdrs = {**AUTH, "Content-Type": "application/json", **(headers or {})}
    data = content if content is not None else json.dumps(body).encode()
    return httpx.post(base + "/v1/chat/completions", content=data, headers=hdrs, timeout=60, **kw)


def chat(**extra) -> dict:
    return {"model": "safe", "messages": HELLO, "max_tokens": 2, **extra}


def answers(base: str) -> None:
    """The server still serves: a normal request gets its reply."""
    r = post(base, chat())
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text


# ---- bounded work before any queue ---------------------------------------------------------------
def test_doubling_schema_is_refused_in_milliseconds_while_health_answers(server):
    """16 and 24 levels (2-3 KB; unrolled they would be 10 MB and 2.5 GB): refused while the
    schema is unrolled, as soon as it passes the node budget. Before the budget the 16-level
    request took 2.5 s and held /health 2 s (the issue's measurement); each level doubles that.
    The bounds asserted are the issue's 100 ms; measured here on 2 loaded cores: 40-80 ms for the
    refusal and under 20 ms for /health."""

    async def main():
        async with httpx.AsyncClient(timeout=30, headers=AUTH) as c:
            stop_probe, lat = asyncio.Event(), []

            async def probe():
                while not stop_probe.is_set():
                    t = time.perf_counter()
                    assert (await c.get(server + "/health")).status_code == 200
                    lat.append(time.perf_counter() - t)
                    await asyncio.sleep(0.005)

            task = asyncio.create_task(probe())
            await asyncio.sleep(0.05)
            took = {}
            for levels in (16, 24, 16, 24):
                schema = {"type": "json_schema", "json_schema": {"name": "d", "schema": doubling(levels)}}
                t = time.perf_counter()
                r = await c.post(server + "/v1/chat/completions", json=chat(response_format=schema))
                took.setdefault(levels, []).append(time.perf_counter() - t)
                assert r.status_code == 400 and "grows past 10000" in r.json()["error"]["message"], r.text
                assert r.json()["error"]["param"] == "response_format"
            stop_probe.set()
            await task
            return took, lat

    took, lat = asyncio.run(main())
    # the faster of two tries: a refusal's own cost, not a pause of the shared 2-core machine
    assert all(min(t) < 0.1 for t in took.values()), took
    assert len(lat) >= 5 and sorted(lat)[int(0.9 * (len(lat) - 1))] < 0.1, sorted(lat)[-5:]
    answers(server)


def test_the_same_budget_holds_for_a_forced_tool_call(server):
    tool = {"type": "function", "function": {"name": "f", "parameters": doubling(24)}}
    t = time.perf_counter()
    r = post(server, chat(tools=[tool], tool_choice="required"))
    assert r.status_code == 400 and "tool 'f'" in r.json()["error"]["message"] and time.perf_counter() - t < 1.0
    answers(server)


def test_a_check_past_its_time_bound_is_a_400_and_health_never_waits(server):
    """5000 properties (OpenAI's limit, so accepted by the size checks) take about 4 s to check and
    compile here; the server's --check-timeout 1 answers after 1 s, /health answering meanwhile."""
    flat = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}

    async def main():
        async with httpx.AsyncClient(timeout=30, headers=AUTH) as c:
            req = asyncio.create_task(
                c.post(
                    server + "/v1/chat/completions",
                    json=chat(response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": flat}}),
                )
            )
            lat = []
            while not req.done():
                t = time.perf_counter()
                assert (await c.get(server + "/health")).status_code == 200
                lat.append(time.perf_counter() - t)
                await asyncio.sleep(0.02)
            return await req, lat

    r, lat = asyncio.run(main())
    assert r.status_code == 400 and "took longer than 1 s" in r.json()["error"]["message"], r.text
    assert len(lat) >= 10 and max(lat) < 0.5, sorted(lat)[-3:]
    answers(server)


BIG = b'{"model": "safe", "max_tokens": 2, "messages": [{"role": "user", "content": "' + b"x" * 5_000_000 + b'"}]}'
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
# (what, how to send it, status, param or None, a phrase of the message)
CASES = [
    ("text/plain body", dict(headers={"Content-Type": "text/plain"}), 415, "content-type", "must be JSON"),
    ("form body", dict(headers={"Content-Type": "application/x-www-form-urlencoded"}), 415, "content-type", "JSON"),
    ("no content type", dict(headers={"Content-Type": ""}), 415, "content-type", "no content type"),
    ("foreign Host", dict(headers={"Host": "evil.example"}), 421, None, "does not answer for the Host"),
    ("5 MB body", dict(content=BIG), 413, None, "larger than this server takes"),
    ("5 MB body, Content-Length hidden", dict(content=iter([BIG])), 413, None, "larger than this server takes"),
    ("100 stop strings", dict(body=chat(stop=["a"] * 100)), 400, "stop", "at most 4 stop strings"),
    (
        "129 tools",
        dict(body=chat(tools=[{**TOOL, "function": {**TOOL["function"], "name": f"f{i}"}} for i in range(129)])),
        400,
        "tools",
        "at most 128",
    ),
    ("2049 messages", dict(body=chat(messages=HELLO * 2049)), 400, "messages", "at most 2048"),
    ("wrong model", dict(body=chat(model="gpt-4o")), 404, "model", "does not exist here"),
    ("JSON nested 100k deep", dict(content=b"[" * 100_000), 400, None, "nests JSON too deeply"),
    ("not UTF-8", dict(content=b'{"model": "\xff"}'), 400, None, "not JSON"),
    (
        "11 levels of objects",
        dict(
            body=chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {
                        "name": "n",
                        "schema": json.loads(
                            '{"type": "object", "properties": {"a": ' * 11 + '{"type": "string"}' + "}}" * 11
                        ),
                    },
                }
            )
        ),
        400,
        "response_format",
        "nests objects 11 levels deep",
    ),
    (
        "1001 enum values",
        dict(
            body=chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "e", "schema": {"enum": list(range(1001))}},
                }
            )
        ),
        400,
        "response_format",
        "more than 1000 enum values",
    ),
]


@pytest.mark.parametrize("what, how, status, param, phrase", CASES, ids=[c[0] for c in CASES])
def test_refused_before_any_queue(server, what, how, status, param, phrase):
    r = post(server, how.get("body", chat()), headers=how.get("headers"), content=how.get("content"))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert re.search(phrase, err["message"]) and err["param"] == param, err
    answers(server)


def test_structured_output_that_cannot_fit_names_the_tokens_it_needs(server):
    """A recursive Node with a required child at 8 tokens: the shortest document needs more."""
    node = NODE_SCHEMA
    fmt = {"type": "json_schema", "json_schema": {"name": "node", "schema": node}}
    r = post(server, chat(response_format=fmt, max_tokens=8))
    assert r.status_code == 400, r.text
    assert re.search(r"structured output \(json_schema\) needs at least \d+ tokens.*is 8", r.json()["error"]["message"])
    r = post(server, chat(response_format=fmt, max_tokens=40))
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), node)


# ---- browsers kept out ---------------------------------------------------------------------------
def test_key_covers_metrics_health_shows_nothing_without_it_and_docs_are_off(server):
    assert httpx.get(server + "/metrics").status_code == 401
    assert "ensemble_queue_depth" in httpx.get(server + "/metrics", headers=AUTH).text
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    assert "queue" in httpx.get(server + "/health", headers=AUTH).json()
    assert httpx.get(server + "/health", headers={"Host": "evil.example"}).status_code == 200  # probes use the pod IP
    assert httpx.get(server + "/v1/models", headers={**AUTH, "Host": "evil.example"}).status_code == 421
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(server + path).status_code == 404
    assert post(server, chat(), headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_cors_stays_closed(server):
    origin = {"Origin": "https://evil.example"}
    r = post(server, chat(), headers=origin)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    pre = httpx.options(
        server + "/v1/chat/completions",
        headers={**origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"},
    )
    assert "access-control-allow-origin" not in pre.headers  # the browser sends nothing after this


# ---- slots and streams released on every path ------------------------------------------------------
def test_abandoned_streams_give_their_queue_slots_back(server):
    """8 streams abandoned right after they were sent (some before their first event) on a server
    whose queue holds 4: a slot that was not given back would turn the later ones into 429s."""
    body = json.dumps(chat(max_tokens=200, stream=True)).encode()
    for _ in range(8):
        with httpx.Client(timeout=30) as c:
            with c.stream(
                "POST",
                server + "/v1/chat/completions",
                content=body,
                headers={**AUTH, "Content-Type": "application/json"},
            ) as r:
                assert r.status_code == 200
    deadline = time.time() + 30
    while time.time() < deadline and httpx.get(server + "/health", headers=AUTH).json()["queue"]:
        time.sleep(0.1)
    assert httpx.get(server + "/health", headers=AUTH).json()["queue"] == 0
    answers(server)


def test_the_client_closes_a_stream_its_caller_abandons(server):
    """RemoteEnsemble (both facades' client mode): a caller that stops reading after one delta
    closes the response, the server sees the disconnect and stops the request, so it never
    completes: no 200 is counted for it, and its queue slot comes back long before 1500 tokens."""
    from ensemble_llm.client import RemoteEnsemble

    def served_200() -> float:
        text = httpx.get(server + "/metrics", headers=AUTH).text
        line = re.search(r'ensemble_requests_total\{endpoint="/v1/chat/completions",status="200"\} (\S+)', text)
        return float(line.group(1)) if line else 0.0

    before = served_200()
    remote = RemoteEnsemble(server + "/v1", api_key=KEY, max_retries=0)
    for delta in remote.stream("Tell a long story.", max_new_tokens=1500):
        assert isinstance(delta, str)
        break
    deadline = time.time() + 30
    while time.time() < deadline and httpx.get(server + "/health", headers=AUTH).json()["queue"]:
        time.sleep(0.05)
    assert httpx.get(server + "/health", headers=AUTH).json()["queue"] == 0
    assert served_200() == before  # stopped, not finished
    answers(server)


# ---- one bad call never fails another; nothing leaked --------------------------------------------
FAULT_AT = 200  # positions: only the long prompt's rows reach them (the others stay under 40 + 120)
LAUNCHER = """
import os, sys
from transformers.models.llama import modeling_llama

FAULT_AT = int(os.environ["FAULT_AT"])
real_forward = modeling_llama.LlamaModel.forward


def forward(self, *args, **kw):
    # a decode step (one new column) holding a row past FAULT_AT, the long prompt's request: a
    # batched step names each row's position, a row's own forward has them from its cache's length
    ids, pos, cache = kw.get("input_ids"), kw.get("position_ids"), kw.get("cache")
    at = int(pos.max()) if pos is not None else (cache.get_seq_length() if cache is not None else 0)
    if ids is not None and ids.shape[1] == 1 and at >= FAULT_AT:
        print(f"fault: a forward of {ids.shape[0]} rows holds the poisoned request", file=sys.stderr, flush=True)
        raise RuntimeError("injected fault in /srv/secret/model.py (pid 4242)")
    return real_forward(self, *args, **kw)


modeling_llama.LlamaModel.forward = forward
from ensemble_llm.cli import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def faulty(tiny_dirs, tmp_path_factory):
    """A real `ensemble-llm serve` (the CLI's own main) whose SmolLM2 member raises in any decode
    step that holds a row past position FAULT_AT; the key from --api-key-file, CORS open to one origin."""
    folder = tmp_path_factory.mktemp("faulty")
    launcher, key_file, log = folder / "launch.py", folder / "key", folder / "server.log"
    launcher.write_text(LAUNCHER)
    key_file.write_text(KEY + "\n")
    args = ["--models", tiny_dirs["smol"], "--method", "single", "--api-key-file", str(key_file)]
    args += ["--cors-origin", "https://app.example", "--max-batch", "8"]
    proc, base = serve(args, log, env={"FAULT_AT": str(FAULT_AT)}, launcher=launcher)
    yield base, log
    stop(proc)


async def _stream_text(c, base: str, body: dict, started: asyncio.Event | None = None) -> tuple[str, list]:
    """A streamed chat completion's text and its error events; `started` is set at the first delta."""
    text, errors = "", []
    async with c.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
            for ch in event.get("choices", []):
                text += ch["delta"].get("content") or ""
                if started is not None and ch["delta"].get("content"):
                    started.set()
    return text, errors


def _generic(err: dict) -> None:
    """A 500's error: the request id and nothing of the fault (its text, path, pid, type, traceback)."""
    assert err["type"] == "server_error" and err["code"] == "internal_error"
    assert re.search(r"request id (chatcmpl|cmpl)-[0-9a-f]{24}", err["message"]), err
    for leak in ("injected", "secret", "/srv", "4242", "RuntimeError", "Traceback", ".py"):
        assert leak not in err["message"], err


def test_a_failing_call_fails_only_its_own_request_and_leaks_nothing(faulty):
    """Three requests decode together; then two with a long prompt join their batched steps (one
    streamed, one not). Their rows make the step raise: the step's calls are run again one by one,
    so the two long ones fail (a generic 500, a generic error event) and the three others finish
    with the very text each gets alone."""
    base, log = faulty
    prompts = ["Tell a story about a cat.", "Count to ten.", "Name a colour."]
    bodies = [{"model": "ensemble", "messages": [{"role": "user", "content": p}], "max_tokens": 120} for p in prompts]
    alone = [httpx.post(base + "/v1/chat/completions", json=b, headers=AUTH, timeout=60).json() for b in bodies]
    alone = [a["choices"][0]["message"]["content"] for a in alone]
    poisoned = {"model": "ensemble", "messages": [{"role": "user", "content": "word " * FAULT_AT}], "max_tokens": 8}

    async def main():
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as c:
            started = [asyncio.Event() for _ in bodies]
            good = [asyncio.create_task(_stream_text(c, base, b, s)) for b, s in zip(bodies, started)]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)  # all three decoding
            bad = await asyncio.gather(
                c.post(base + "/v1/chat/completions", json=poisoned), _stream_text(c, base, poisoned)
            )
            return await asyncio.gather(*good), bad

    good, (bad_reply, (_, bad_errors)) = asyncio.run(main())
    assert [t for t, _ in good] == alone and all(not errors for _, errors in good)
    assert bad_reply.status_code == 500
    _generic(bad_reply.json()["error"])
    assert len(bad_errors) == 1  # (its first token came from the prompt's forward: it may show, then the error)
    _generic(bad_errors[0])
    text = log.read_text()
    rows = [int(n) for n in re.findall(r"fault: a forward of (\d+) rows", text)]
    assert rows and max(rows) >= 4, text[-2000:]  # the fault struck inside a batched step
    rid = re.search(r"request id (\S+?)\)", bad_reply.json()["error"]["message"]).group(1)
    assert re.search(rf"request {rid} failed: GenerationError: .*injected fault", text), text[-2000:]
    r = httpx.post(base + "/v1/chat/completions", json=bodies[0], headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == alone[0]


def test_the_key_file_and_a_configured_cors_origin(faulty):
    base, _ = faulty
    assert httpx.get(base + "/v1/models").status_code == 401
    assert httpx.get(base + "/v1/models", headers=AUTH).status_code == 200
    r = httpx.get(base + "/v1/models", headers={**AUTH, "Origin": "https://app.example"})
    assert r.headers.get("access-control-allow-origin") == "https://app.example"
    r = httpx.get(base + "/v1/models", headers={**AUTH, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
