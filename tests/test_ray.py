"""placement="ray": every member in a Ray actor of a local cluster started here (2 CPUs).

Greedy output equals placement="local" token for token (and the same forwards run) for every
method, on tiny random-weight members and on the real bundled pair; streaming, async, stop
strings and timeouts behave the same; a member actor killed mid-stream fails that request with
an error naming the member and the next request succeeds; resources the cluster lacks fail at
load; the facades and `ensemble-llm serve` accept placement="ray"."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from helpers import GEMMA, SMOL, TINY_METHODS, start_server, tiny_pair_for
from test_split import split_options

from ensemble_llm import ConfigError, Ensemble, GenerationError, KVBudgetError, RequestTimeout
from ensemble_llm.chat import render_chat
from ensemble_llm.members import TokenLM
from ensemble_llm.ray import clear_actors

pytestmark = pytest.mark.ray

# four member actors (tiny and real pair) on a 2-CPU cluster, a quarter CPU each (one torch thread)
RES = {"num_cpus": 0.25}
METHODS = ["single", "unite", "safe", "specfuse", "smc"]
CONFIGS = {"smc": {"n_particles": 2}}
PROMPT = "Name three colours and say why the sky is blue."


@pytest.fixture(scope="module")
def cluster():
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    clear_actors()
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny_pair(tiny_dirs):
    return [tiny_dirs["smol"], tiny_dirs["gemma"]]


def pair(models, method, placement):
    kw = {"placement": "ray", "member_resources": RES} if placement == "ray" else {}
    return Ensemble(models, method, CONFIGS.get(method), progress=False, **kw)


def same_run(a, b):
    """Equal text, finish and tokens, and the same forward passes on every member."""
    assert b.text == a.text
    assert b.finish_reason == a.finish_reason
    assert b.run_stats.tokens_out == a.run_stats.tokens_out
    for name, m in a.stats["members"].items():
        assert b.stats["members"][name]["forward_passes"] == m["forward_passes"], name
        assert b.stats["members"][name]["prefills"] == m["prefills"], name


@pytest.mark.parametrize("method", METHODS)
def test_ray_equals_local_tiny(cluster, tiny_pair, method):
    local, remote = pair(tiny_pair, method, "local"), pair(tiny_pair, method, "ray")
    assert all(isinstance(m, TokenLM) and m.remote for m in remote.members)
    for prompt in (PROMPT, "Hello"):
        a = local.generate(prompt, max_new_tokens=12)
        b = remote.generate(prompt, max_new_tokens=12)
        same_run(a, b)
        moved = b.stats["bytes_moved"]
        assert moved > 0 and sum(m["bytes_moved"] for m in b.stats["members"].values()) == moved
        # only small results cross: per forward pass, far less than one vocabulary row (SmolLM2: 49152 x 4 bytes)
        forwards = sum(m["forward_passes"] for m in b.stats["members"].values())
        assert moved / forwards < 49152 * 4 / 10
    assert "bytes_moved" not in a.stats


@pytest.mark.real
@pytest.mark.parametrize("method", METHODS)
def test_ray_equals_local_real_pair(cluster, method):
    local, remote = pair([SMOL, GEMMA], method, "local"), pair([SMOL, GEMMA], method, "ray")
    budget = 6 if method == "smc" else 16
    a = local.generate(PROMPT, max_new_tokens=budget)
    b = remote.generate(PROMPT, max_new_tokens=budget)
    assert a.text.strip()
    same_run(a, b)
    assert b.stats["bytes_moved_per_token"] < 262144 * 4 / 10  # a tenth of one Gemma row


@pytest.mark.real
def test_ray_stop_strings_real_pair(cluster):
    local, remote = pair([SMOL, GEMMA], "unite", "local"), pair([SMOL, GEMMA], "unite", "ray")
    full = local.generate(PROMPT, max_new_tokens=16).text
    words = full.split()
    assert len(words) >= 3
    stop = " " + words[2]
    a = local.generate(PROMPT, max_new_tokens=16, stop=[stop])
    b = remote.generate(PROMPT, max_new_tokens=16, stop=[stop])
    assert stop not in a.text and a.finish_reason == "stop"
    same_run(a, b)


def test_ray_streaming_async_and_timeout(cluster, tiny_pair):
    local, remote = pair(tiny_pair, "safe", "local"), pair(tiny_pair, "safe", "ray")
    want = local.generate(PROMPT, max_new_tokens=20)
    stream = remote.stream(PROMPT, max_new_tokens=20)
    chunks = list(stream)
    assert len(chunks) > 1 and "".join(chunks) == want.text == stream.result.text

    async def both():
        return await asyncio.gather(
            remote.agenerate(PROMPT, max_new_tokens=20), remote.agenerate("Hello", max_new_tokens=8)
        )

    a, b = asyncio.run(both())
    assert a.text == want.text and b.text == local.generate("Hello", max_new_tokens=8).text

    async def astream():
        return [c async for c in remote.astream(PROMPT, max_new_tokens=20)]

    assert "".join(asyncio.run(astream())) == want.text
    t = time.perf_counter()
    with pytest.raises(RequestTimeout):
        remote.generate(PROMPT, max_new_tokens=1500, timeout=0.5)
    assert time.perf_counter() - t < 3.0
    assert remote.generate(PROMPT, max_new_tokens=20).text == want.text  # the engine (and actors) still serve


MANY = ["The capital of France is", "Write a haiku about rain.", "2+2=", "List three colors:", "Once upon a"]


@pytest.mark.parametrize("method,config", TINY_METHODS, ids=[m for m, _ in TINY_METHODS])
def test_ray_requests_at_once_share_the_actors_forwards(cluster, tiny_dirs, method, config):
    """Five requests of different lengths on four slots through the member actors: each gets its
    text and its forward count of one at a time, locally; the actors ran fewer forwards than the
    requests took part in (the caller's steps reach each actor as one batched call)."""
    members = tiny_pair_for(method, tiny_dirs)
    one = Ensemble(members, method, config, max_batch=1, progress=False)
    many = Ensemble(members, method, config, max_batch=4, progress=False, placement="ray", member_resources=RES)
    assert many.load().max_batch == 4
    jobs = [(p, 10 + 4 * i) for i, p in enumerate(MANY)]
    alone = [one.generate(p, max_new_tokens=n, raw=True) for p, n in jobs]
    before = [m.n_forward for m in many.members]  # outside a request: the actor's totals
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda j: many.generate(j[0], max_new_tokens=j[1], raw=True), jobs))
    assert [r.text for r in together] == [r.text for r in alone]
    for a, b in zip(alone, together):  # each request's own figures, though others ran beside it
        for name, st in a.stats["members"].items():
            assert b.stats["members"][name]["forward_passes"] == st["forward_passes"], name
            assert b.stats["members"][name]["prefills"] == st["prefills"], name
    ran = sum(m.n_forward for m in many.members) - sum(before)
    took_part = sum(st["forward_passes"] for r in together for st in r.stats["members"].values())
    # batched: 0.41 to 0.56 of them here; with the extends sent one by one (only the prompts
    # batched) 0.94 to 0.97; smc 0.48 to 0.53, and 1.0 with its byte LMs asked one request at a time
    assert ran < 0.75 * took_part
    assert ran <= took_part and many.scheduler.idle


FEW_SHOT = "Q: The capital of France is\nA: Paris\nQ: The capital of Japan is\nA: Tokyo\nQ: The capital of {} is\nA:"


def test_ray_few_shot_requests_at_once_score_their_prompts_together(cluster, tiny_pair, monkeypatch):
    """Per-request weights through the actors: four few-shot requests at once get their local
    one-at-a-time evidence, weights, texts, forwards and prefills (each scored prompt runs once
    and is handed to the prefill that follows on its actor), and the scorings share forwards."""
    from ensemble_llm.ray import member as ray_member

    prompts = [FEW_SHOT.format(c) for c in ("Peru", "Chile", "Italy", "Kenya")]
    one = Ensemble(tiny_pair, "unite", {"evidence": 1}, max_batch=1, progress=False)
    many = Ensemble(
        tiny_pair, "unite", {"evidence": 1}, max_batch=4, progress=False, placement="ray", member_resources=RES
    ).load()
    alone = [one.generate(p, raw=True, max_new_tokens=6, stop=["\n"]) for p in prompts]
    scored, run_batch = [], ray_member.RayMember.run_batch

    def spy(self, kind, calls):  # how many scored prompts each batched actor call carried
        scored.append(sum(getattr(c, "positions", None) is not None for c in calls))
        return run_batch(self, kind, calls)

    monkeypatch.setattr(ray_member.RayMember, "run_batch", spy)
    before = [m.n_forward for m in many.members]
    together = many.generate_many(prompts, raw=True, max_new_tokens=6, stop=["\n"])
    assert max(scored) >= 2  # several requests' scorings in one actor call
    for a, b in zip(alone, together):
        assert b.text == a.text
        assert b.stats["evidence"] == pytest.approx(a.stats["evidence"], abs=2e-3)
        assert b.stats["member_weights"] == pytest.approx(a.stats["member_weights"], abs=1e-3)
        for name, st in a.stats["members"].items():
            assert b.stats["members"][name]["forward_passes"] == st["forward_passes"], name
            assert b.stats["members"][name]["prefills"] == st["prefills"] == 1, name
    ran = sum(m.n_forward for m in many.members) - sum(before)
    took_part = sum(st["forward_passes"] for r in together for st in r.stats["members"].values())
    assert ran < took_part


def test_ray_members_kv_caches_count_against_the_budget(cluster, tiny_pair):
    """Each member actor is a device of its own in the KV budget: a request that could not fit
    is refused naming it, and "auto" fixes one limit per actor from the memory it found free."""
    tight = Ensemble(tiny_pair, "unite", progress=False, placement="ray", member_resources=RES, kv_budget=4096)
    with pytest.raises(KVBudgetError, match=r"on ray:tiny_smol0#\d+.*kv_budget"):
        tight.generate(PROMPT, max_new_tokens=200)
    local, remote = pair(tiny_pair, "unite", "local"), pair(tiny_pair, "unite", "ray")
    a, b = local.generate(PROMPT, max_new_tokens=6), remote.generate(PROMPT, max_new_tokens=6)
    limits = remote.kv_budget.limits()
    assert set(limits) == {m.kv_device for m in remote.members} and all(v > 2**20 for v in limits.values())
    for name, st in a.stats["members"].items():  # tiny llama: 2 layers x 2 heads x 8 x K and V x 4 bytes
        assert b.stats["members"][name]["kv_bytes_per_token"] == st["kv_bytes_per_token"]
    assert b.stats["members"]["tiny_smol0"]["kv_bytes_per_token"] == 2 * 2 * 2 * 8 * 4


def test_ray_members_load_with_their_options(cluster, four_layer_dirs, tmp_path):
    """Per-member options reach the actor: a member split by max_memory over CPU and disk, and an
    int8 member (torchao), each give the text the same member gives locally."""
    import importlib.util

    folder = four_layer_dirs["smol"]  # varied greedy text
    opts = split_options(folder, tmp_path)
    split = {"model": folder, "max_memory": dict(opts.max_memory), "offload_folder": opts.offload_folder}
    specs = [split]
    if importlib.util.find_spec("torchao") is not None:
        specs.append({"model": folder, "quantization": "int8"})
    for spec, key, want in zip(specs, ("placed", "quantized"), (["cpu", "disk"], "torchao")):
        local = Ensemble([spec], "single", progress=False)
        remote = Ensemble([spec], "single", progress=False, placement="ray", member_resources=RES).load()
        assert ray.get(remote.members[0].actor.info.remote())[key] == want  # loaded so in its actor
        a, b = local.generate(PROMPT, max_new_tokens=12), remote.generate(PROMPT, max_new_tokens=12)
        assert b.text == a.text and a.text.strip(), spec


def test_ray_actor_killed_mid_stream(cluster, tiny_pair):
    local, remote = pair(tiny_pair, "unite", "local"), pair(tiny_pair, "unite", "ray")
    want = local.generate(PROMPT, max_new_tokens=12).text
    victim = remote.members[1]
    stream = iter(remote.stream(PROMPT, max_new_tokens=1500))
    next(stream)
    ray.kill(victim.actor, no_restart=False)  # dies like an OOM kill: Ray restarts it
    t = time.perf_counter()
    with pytest.raises(GenerationError, match=victim.name) as err:
        for _ in stream:
            pass
    assert "Ray actor" in str(err.value) and time.perf_counter() - t < 30
    # the next request runs on the restarted actor and gives the same text
    assert remote.generate(PROMPT, max_new_tokens=12).text == want


def test_ray_actor_killed_mid_request_is_retried(cluster, tiny_pair):
    """max_retries covers a dead member: the retry waits for Ray's restart and gives the local text."""
    import threading

    want = pair(tiny_pair, "unite", "local").generate(PROMPT, max_new_tokens=200).text
    remote = pair(tiny_pair, "unite", "ray")
    victim = remote.members[0]
    start, out = victim.round_trips, {}
    worker = threading.Thread(target=lambda: out.update(res=remote.generate(PROMPT, max_new_tokens=200, max_retries=1)))
    worker.start()
    while victim.round_trips < start + 10:  # the request is under way on the victim
        time.sleep(0.005)
    ray.kill(victim.actor, no_restart=False)
    worker.join(timeout=120)
    assert out["res"].text == want and out["res"].stats["retries"] == 1


def test_ray_unplaceable_resources_fail_at_load(cluster, tiny_pair):
    engine = Ensemble(tiny_pair, "unite", progress=False, placement="ray", member_resources={"num_gpus": 1})
    t = time.perf_counter()
    with pytest.raises(ConfigError, match=r"cannot place these members: GPU needs 2, the cluster has 0"):
        engine.load()
    assert time.perf_counter() - t < 10
    with pytest.raises(ConfigError, match="custom resource"):
        Ensemble(tiny_pair, "unite", placement="ray", member_resources={"resources": {"accel": -1}})
    engine = Ensemble(
        tiny_pair,
        "unite",
        progress=False,
        placement="ray",
        member_resources=[RES, {"num_cpus": 0.25, "resources": {"no_such_accelerator": 1}}],
    )
    with pytest.raises(ConfigError, match="no_such_accelerator needs 1, the cluster has 0"):
        engine.load()


def test_ray_member_that_cannot_load_fails_at_load_and_frees_its_place(cluster, tiny_pair, tmp_path):
    """A folder that looks right but whose weights are garbage fails inside its actor: a ConfigError
    naming the member, and nothing stays reserved (the next placement of a good pair works)."""
    import shutil

    bad = tmp_path / "broken_model"
    shutil.copytree(tiny_pair[0], bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file" * 100)
    free = ray.available_resources().get("CPU", 0)
    engine = Ensemble([str(bad), tiny_pair[1]], "unite", progress=False, placement="ray", member_resources=RES)
    with pytest.raises(ConfigError, match="'broken_model' could not load in its Ray actor"):
        engine.load()
    deadline = time.time() + 20
    while ray.available_resources().get("CPU", 0) < free and time.time() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) >= free
    assert pair(tiny_pair, "unite", "ray").generate("Hello", max_new_tokens=4).text is not None


def test_placement_arguments_are_checked(tiny_pair):
    with pytest.raises(ConfigError, match="placement must be 'local'"):
        Ensemble(tiny_pair, "unite", placement="rey")
    with pytest.raises(ConfigError, match="needs placement='ray'"):
        Ensemble(tiny_pair, "unite", ray_address="auto")
    with pytest.raises(ConfigError, match="member_resources applies to placement='ray'"):
        Ensemble(tiny_pair, "unite", member_resources={"num_cpus": 1})
    with pytest.raises(ConfigError, match="unknown keys"):
        Ensemble(tiny_pair, "unite", placement="ray", member_resources={"num_cpu": 1})
    with pytest.raises(ConfigError, match="one per member"):
        Ensemble(tiny_pair, "unite", placement="ray", member_resources=[RES])
    with pytest.raises(ConfigError, match="device is its actor's"):
        Ensemble(tiny_pair, "unite", placement="ray", device="cpu")


def test_facades_accept_ray_placement(cluster, tiny_pair):
    from langchain_ensemble_llm import EnsembleLLM as LCEnsemble
    from llama_index.llms.ensemble_llm import EnsembleLLM as LIEnsemble

    want = pair(tiny_pair, "safe", "local").generate(PROMPT, max_new_tokens=10).text
    lc = LCEnsemble(
        members=tiny_pair, method="safe", placement="ray", member_resources=RES, max_tokens=10, progress=False
    )
    assert lc.engine.placement == "ray"
    assert lc.invoke(PROMPT).content == want
    li = LIEnsemble(
        members=tiny_pair, method="safe", placement="ray", member_resources=RES, max_new_tokens=10, progress=False
    )
    assert li.complete(PROMPT).text == want


def test_serve_with_ray_placement(cluster, tiny_pair):
    import openai

    want = pair(tiny_pair, "safe", "local").generate(PROMPT, max_new_tokens=10).text
    proc, base = start_server(
        tiny_pair,
        "safe",
        extra=["--placement", "ray", "--ray-address", "auto", "--member-resources", '{"num_cpus": 0.25}'],
    )
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        res = client.chat.completions.create(
            model="ensemble", messages=[{"role": "user", "content": PROMPT}], max_tokens=10
        )
        assert res.choices[0].message.content == want
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("method", ["single", "safe"])
def test_ray_grammar_constraints_equal_local(cluster, tiny_pair, method):
    """A grammar masks whole rows: over Ray the mask (1 bit per token) goes to the actor and the
    row stays there; the text and the forwards are the local engine's."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "n"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    a = pair(tiny_pair, method, "local").generate(PROMPT, max_new_tokens=40, response_format=fmt)
    remote = pair(tiny_pair, method, "ray")
    b = remote.generate(PROMPT, max_new_tokens=40, response_format=fmt)
    same_run(a, b)
    assert a.stats["masked_rows"] == b.stats["masked_rows"] > 0
    forwards = sum(m["forward_passes"] for m in b.stats["members"].values())
    # a whole row of float32 log-probs is 4 bytes a token; a mask is 1 bit a token of the masked
    # member (the drafter, whichever member that is), so far less than a tenth of a row crosses
    row = 4 * max(m.vocab_size for m in remote.members)
    assert 0 < b.stats["bytes_moved"] / forwards < row / 10


def test_ray_tokenizers_come_from_the_actors(cluster, tiny_pair):
    """The caller needs no model files: each member's tokenizer is the one its actor loaded,
    sent once and kept in the cache folder by digest."""
    local, remote = pair(tiny_pair, "unite", "local").members, pair(tiny_pair, "unite", "ray").members
    msgs = [{"role": "user", "content": "Héllo, wörld! 1 + 1 = 2 🙂"}]
    for a, b in zip(local, remote):
        assert "ray-tokenizers" in str(b.tokenizer.name_or_path)
        assert b.vocab_bytes == a.vocab_bytes and b.special_ids == a.special_ids and b.eos_ids == a.eos_ids
        assert render_chat(b, msgs) == render_chat(a, msgs)
        assert b.encode_with_offsets("Héllo 🙂 wörld") == a.encode_with_offsets("Héllo 🙂 wörld")
        assert b.context_window == a.context_window and b.vocab_size == a.vocab_size
