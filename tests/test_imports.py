import subprocess
import sys


def test_core_imports_no_framework():
    code = (
        "import ensemble_llm, sys; "
        "bad = [m for m in sys.modules if m.startswith(('langchain', 'llama_index'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
