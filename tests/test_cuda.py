"""CUDA paths (skipped without a GPU): every method in bf16 on the GPU, members split across
devices, batched SMC rows on the GPU, concurrent requests batched on the GPU (with the KV
budget's "auto" limit), and the bench recording the device."""

from __future__ import annotations

import pytest
import torch

from ensemble_llm import Ensemble

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
METHODS = ["single", "unite", "safe", "specfuse", "smc"]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_runs_in_bf16_on_the_gpu(tiny_dirs, method):
    eng = Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method=method, device="cuda", dtype="bfloat16")
    res = eng.generate("Tell me about the sea.", max_new_tokens=12)
    assert all(m.device.type == "cuda" and m.dtype == torch.bfloat16 for m in eng.members)
    assert res.finish_reason in ("stop", "length") and res.stats["tokens_out"] <= 13
    assert sum(v["forward_passes"] for v in res.stats["members"].values()) >= 1
    assert "".join(eng.stream("Tell me about the sea.", max_new_tokens=12)) == res.text  # greedy / fixed seed


@pytest.mark.parametrize("method", ["safe", "specfuse", "smc"])
def test_members_on_different_devices(tiny_dirs, method):
    eng = Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method=method, device=["cuda", "cpu"], dtype="float32")
    res = eng.generate("Hello there", max_new_tokens=10)
    assert [m.device.type for m in eng.members] == ["cuda", "cpu"]
    ref = Ensemble([tiny_dirs["smol"], tiny_dirs["gemma"]], method=method, device="cpu", dtype="float32")
    # float32 on both: the same text as an all-CPU run, up to kernel rounding on near-ties
    assert res.text[:8] == ref.generate("Hello there", max_new_tokens=10).text[:8]


def test_forward_rows_on_the_gpu(tiny_dirs):
    from ensemble_llm.members import load_member

    m = load_member(tiny_dirs["gemma"], device="cuda", dtype="float32")
    prompt = list(range(5, 15))
    pkv = m.kv_tensor(m.prefill(prompt))
    _, (kv20,) = m.forward_rows(pkv, [[]], [20])
    logits, _ = m.forward_rows(pkv, [[kv20], []], [21, 40])
    ref = m.forward_batch([prompt + [20, 21], prompt + [40]])
    for r in range(2):
        assert torch.allclose(torch.log_softmax(logits[r], -1), ref[r][-1], atol=1e-3)


def test_bench_records_the_gpu(tiny_dirs):
    from ensemble_llm.bench import parse_methods, resolve_task, run_bench

    res = run_bench(
        [tiny_dirs["smol"], tiny_dirs["gemma"]],
        parse_methods(["single:member=0", "smc:n_particles=2"], 2),
        [resolve_task("qa_wikidata:2", 0)],
        speed_prompts=1,
        max_new_tokens=4,
        progress=False,
    )
    assert res["devices"] == ["cuda:0"] and res["cuda"]
    assert all(r["peak_memory_mb"] > 0 for r in res["methods"].values())


@pytest.mark.parametrize("method", ["unite", "safe", "specfuse", "smc"])
def test_ray_members_on_the_gpu(tiny_dirs, method):
    """placement="ray" on a GPU machine: each member actor takes a share of the GPU (its own CUDA
    context), float32 so the text is the in-process one."""
    import ray

    from ensemble_llm.ray import clear_actors

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    try:
        pair = [tiny_dirs["smol"], tiny_dirs["gemma"]]
        cfg = {"n_particles": 2} if method == "smc" else None
        eng = Ensemble(
            pair, method, cfg, dtype="float32", placement="ray", member_resources={"num_gpus": 0.5, "num_cpus": 1}
        )
        res = eng.generate("Tell me about the sea.", max_new_tokens=12)
        assert [m.actor_device for m in eng.members] == ["cuda:0", "cuda:0"]
        ref = Ensemble(pair, method, cfg, device="cuda", dtype="float32").generate(
            "Tell me about the sea.", max_new_tokens=12
        )
        assert res.text == ref.text and res.stats["bytes_moved"] > 0
    finally:
        clear_actors()


@pytest.mark.parametrize("method", METHODS)
def test_concurrent_requests_batch_on_the_gpu(tiny_dirs, method):
    """Continuous batching on CUDA (float32): four concurrent requests get the texts they get one at
    a time, up to near-ties under different kernels (at most one of four may differ), with fewer
    forwards than requests took part in; the "auto" KV budget is a share of the GPU's free memory."""
    from concurrent.futures import ThreadPoolExecutor

    members = [tiny_dirs["smol"]] if method == "single" else [tiny_dirs["smol"], tiny_dirs["gemma"]]
    cfg = {"weights": None, "n_particles": 2} if method == "smc" else None if method == "single" else {"weights": None}
    prompts = ["The capital of France is", "Write a haiku about rain.", "2+2=", "List three colors:"]
    one = Ensemble(members, method, cfg, device="cuda", dtype="float32", max_batch=1)
    many = Ensemble(members, method, cfg, device="cuda", dtype="float32", max_batch=4)
    alone = [one.generate(p, max_new_tokens=16, raw=True).text for p in prompts]
    before = sum(m.n_forward for m in many.members)
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: many.generate(p, max_new_tokens=16, raw=True), prompts))
    assert sum(a == b.text for a, b in zip(alone, together)) >= 3
    took_part = sum(st["forward_passes"] for r in together for st in r.stats["members"].values())
    assert sum(m.n_forward for m in many.members) - before < took_part
    _, total = torch.cuda.mem_get_info(torch.device("cuda"))
    limits = many.kv_budget.limits()
    assert limits and all(0 < v <= total for v in limits.values()), limits
