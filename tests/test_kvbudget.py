"""The KV budget (kvbudget.py): requests run only while their KV bound fits, wait in order while it
does not, are refused when they never could, and the bound really bounds the caches batching holds."""

from __future__ import annotations

import threading
import time

import pytest
from helpers import tiny_pair_for

from ensemble_llm import Ensemble
from ensemble_llm.errors import ConfigError, KVBudgetError, RequestError, RequestTimeout
from ensemble_llm.kvbudget import KVBudget, Reservation, parse_budget
from ensemble_llm.members.backends.transformers import rowgroups

PROMPT = "Say something about rain."


def test_parse_budget_sizes_and_bad_values():
    assert parse_budget("2GB") == 2 * 10**9
    assert parse_budget("512MiB") == 512 * 2**20
    assert parse_budget(" 1.5 kb ") == 1500
    assert parse_budget(4096) == 4096
    assert parse_budget("auto") == "auto" and parse_budget(None) is None
    for bad in (0, -1, "lots", "2XB", True, [1]):
        with pytest.raises(ConfigError, match="kv_budget"):
            parse_budget(bad)
    with pytest.raises(ConfigError, match="kv_budget"):
        Ensemble(["smollm2-135m-instruct"], "single", kv_budget="huge")


def test_bound_pads_a_group_to_its_longest_row_and_adds_trees():
    a = Reservation([("cpu", 10, 100, True), ("cpu", 4, 50, True)])
    b = Reservation([("cpu", 10, 30, True), ("cuda:0", 4, 80, True)])
    # member 0: two rows padded to 100 units; member 1: two rows padded to 80, counted on a's device
    assert KVBudget.bound([a, b]) == {"cpu": 10 * 2 * 100 + 4 * 2 * 80}
    assert KVBudget.bound([a]) == {"cpu": 10 * 100 + 4 * 50}
    t1, t2 = Reservation([("cpu", 10, 100, False)]), Reservation([("cpu", 10, 30, False)])
    assert KVBudget.bound([t1, t2]) == {"cpu": 10 * 130}  # token trees (smc) are not padded


def _one_bound(tiny_dirs, method="single", max_new=8):
    """One request's reserved KV bytes, read from its stats under a budget it fits easily."""
    eng = Ensemble(tiny_pair_for(method, tiny_dirs), method, kv_budget="1GB").load()
    return eng.generate(PROMPT, max_new_tokens=max_new).stats["kv_reserved_bytes"]


def test_a_request_waits_while_the_budget_is_held_then_runs_with_its_text(tiny_dirs):
    one = _one_bound(tiny_dirs)
    eng = Ensemble(tiny_pair_for("single", tiny_dirs), "single", kv_budget=int(1.5 * one)).load()
    alone = eng.generate(PROMPT, max_new_tokens=8)
    assert alone.stats["kv_reserved_bytes"] == one and alone.stats["kv_wait_s"] < 0.05
    out = {}
    hold = Reservation([("cpu", 1, int(1.5 * one), True)])  # the whole budget, held by the test
    with eng.kv_budget.hold(hold, lambda: None):
        t = threading.Thread(target=lambda: out.setdefault("r", eng.generate(PROMPT, max_new_tokens=8)))
        t.start()
        time.sleep(0.4)
        assert "r" not in out  # waiting for room, not running
    t.join(30)
    assert out["r"].text == alone.text and out["r"].stats["kv_wait_s"] >= 0.3


def test_a_deadline_passes_while_waiting_and_the_engine_lives_on(tiny_dirs):
    one = _one_bound(tiny_dirs)
    eng = Ensemble(tiny_pair_for("single", tiny_dirs), "single", kv_budget=2 * one).load()
    with eng.kv_budget.hold(Reservation([("cpu", 1, 2 * one, True)]), lambda: None):
        with pytest.raises(RequestTimeout):
            eng.generate(PROMPT, max_new_tokens=8, timeout=0.3)
    assert eng.kv_budget.in_use() == {}  # nothing left reserved by the timed-out request
    assert eng.generate(PROMPT, max_new_tokens=8).usage.completion_tokens > 0


def test_a_request_that_never_fits_is_refused_by_name(tiny_dirs):
    one = _one_bound(tiny_dirs)
    eng = Ensemble(tiny_pair_for("single", tiny_dirs), "single", kv_budget=2 * one).load()
    with pytest.raises(KVBudgetError, match="kv_budget.*lower max_new_tokens"):
        eng.generate(PROMPT, max_new_tokens=1000)
    assert eng.generate(PROMPT, max_new_tokens=8).usage.completion_tokens > 0  # still usable


def test_the_bound_covers_the_caches_batched_requests_really_hold(tiny_dirs, monkeypatch):
    """safe under load (drafts rolled back: hole columns in the groups): after every batched step,
    each member's group holds no more KV bytes than the budget's bound for the running requests."""
    eng = Ensemble(tiny_pair_for("safe", tiny_dirs), "safe", {"weights": None}, kv_budget="1GB", max_batch=4).load()
    index = {id(m): i for i, m in enumerate(eng.members)}
    seen = []
    step = rowgroups.RowGroup.step

    def checked(group, calls, config):
        step(group, calls, config)
        held = sum(x.nelement() * x.element_size() for layer in group.cache.layers for x in (layer.keys, layer.values))
        i = index[id(group.member)]
        running = [Reservation([r.parts[i]]) for r in eng.kv_budget._running]
        seen.append((held, sum(KVBudget.bound(running).values()), len(calls)))

    monkeypatch.setattr(rowgroups.RowGroup, "step", checked)
    prompts = [PROMPT, "Name three rivers.", "Tell me a long story about a cat and a dog.", "Hi"]
    eng.generate_many(prompts, max_new_tokens=24)
    assert any(n > 1 for _, _, n in seen)  # the requests did step together
    assert all(held <= bound for held, bound, _ in seen), [s for s in seen if s[0] > s[1]][:3]


def test_both_facades_pass_kv_budget_to_their_engine_and_refuse_by_name(tiny_dirs):
    from langchain_ensemble_llm import EnsembleLLM as ChatEnsemble
    from llama_index.llms.ensemble_llm import EnsembleLLM as IndexEnsemble

    members = [tiny_dirs["smol"]]
    chat = ChatEnsemble(members=members, method="single", kv_budget="512KiB", max_tokens=4)
    index = IndexEnsemble(members=members, method="single", kv_budget="512KiB", max_new_tokens=4)
    assert chat.engine is index.engine and chat.engine.kv_budget.value == 512 * 2**10  # one shared engine
    assert chat.invoke("Hi").content == index.complete("Hi").text
    with pytest.raises(RequestError, match="kv_budget"):
        chat.invoke("Hi", max_tokens=1900)
    with pytest.raises(ValueError, match="kv_budget"):  # pydantic's ValidationError, from our ConfigError
        ChatEnsemble(members=members, method="single", kv_budget=-5)
