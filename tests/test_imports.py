import subprocess
import sys


def test_core_imports_no_framework():
    code = (
        "import ensemble_llm, sys; "
        "bad = [m for m in sys.modules if m.startswith(('langchain', 'llama_index'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_facades_import_without_torch():
    """Importing a facade (a LangChain or LlamaIndex app's start-up) loads neither torch nor
    transformers: the engine, and with it the members' libraries, load when an EnsembleLLM is built."""
    for module in ("langchain_ensemble_llm", "llama_index.llms.ensemble_llm", "ensemble_llm.client"):
        code = (
            f"import sys, {module}; "
            "heavy = [m for m in ('torch', 'transformers', 'llama_cpp') if m in sys.modules]; "
            "assert not heavy, heavy"
        )
        subprocess.run([sys.executable, "-c", code], check=True)
