"""Both facades: the `model` field, a shared engine freed when its last facade goes, and the
LlamaIndex context window honoured in process (tiny random-weight members, real tokenizers)."""

from __future__ import annotations

import gc
import threading

import pytest
from langchain_ensemble_llm import EnsembleLLM as LangChainLLM
from llama_index.llms.ensemble_llm import EnsembleLLM as LlamaIndexLLM

from ensemble_llm import Ensemble
from ensemble_llm.sharing import SharedEngines


@pytest.fixture(scope="module")
def pair(tiny_dirs):
    return [tiny_dirs["smol"], tiny_dirs["gemma"]]


@pytest.mark.parametrize("facade", [LangChainLLM, LlamaIndexLLM])
def test_model_is_the_id_in_process_and_a_different_one_is_refused(pair, facade):
    llm = facade(members=pair, method="unite", progress=False)
    assert llm.model == llm.model_name == f"unite:{'+'.join(llm.engine.model_names)}"
    assert facade(members=pair, method="unite", model=llm.model, progress=False).engine is llm.engine
    with pytest.raises(ValueError, match="does not choose models in process.*base_url="):
        facade(members=pair, method="unite", model="gpt-4o", progress=False)
    remote = facade(base_url="http://127.0.0.1:9/v1")
    assert remote.model == remote.engine.model == "ensemble"
    assert facade(base_url="http://127.0.0.1:9/v1", model="safe").engine.model == "safe"


def test_the_last_facade_to_go_frees_the_shared_engine(pair):
    a = LangChainLLM(members=pair, method="safe", max_tokens=3, progress=False)
    b = LlamaIndexLLM(members=pair, method="safe", max_new_tokens=3, progress=False)
    engine = a.engine
    assert b.engine is engine and Ensemble.shared(pair, "safe", progress=False) is engine
    a.invoke("hi")
    assert engine._members is not None
    del a
    gc.collect()
    assert engine._members is not None and b.complete("hi").text is not None  # b still holds it
    b.close()
    assert engine._members is None  # freed: members gone, and the table builds a new engine
    assert Ensemble.shared(pair, "safe", progress=False) is not engine
    own = Ensemble(pair, "safe", progress=False)
    c = LangChainLLM(engine=own, max_tokens=2)
    c.invoke("hi")
    c.close()
    del c
    gc.collect()
    assert own._members is not None  # an engine= you passed stays yours
    own.close()


def test_a_holder_collected_inside_the_table_lock_lets_go_without_a_deadlock(pair):
    """The garbage collector may run a facade's finalizer while the same thread is inside the
    table (building a key, as get_or_add does): the finalizer lets go there too."""

    class Holder:
        pass

    table, engine, holder = SharedEngines(), Ensemble(pair, "unite", progress=False), Holder()
    table.hold_for(holder, engine)
    engine.generate("hi", max_new_tokens=2)

    def collect_inside_the_lock():
        nonlocal holder
        with table._lock:
            holder = None  # the last reference: the finalizer runs here, under the lock
            gc.collect()

    worker = threading.Thread(target=collect_inside_the_lock, daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "the finalizer waited on the lock its own thread holds"
    assert engine._members is None  # the last holder went: the engine was closed


def test_llamaindex_context_window_is_honoured_in_process(pair):
    assert LlamaIndexLLM(members=pair, progress=False).metadata.context_window == 2048  # the members' own
    assert LlamaIndexLLM(members=pair, context_window=512, progress=False).metadata.context_window == 512
    with pytest.warns(UserWarning, match="more than the members hold"):
        window = LlamaIndexLLM(members=pair, context_window=100_000, progress=False).metadata.context_window
    assert window == 2048
