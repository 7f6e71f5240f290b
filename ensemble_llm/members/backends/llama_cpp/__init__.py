"""The llama.cpp backend: GGUF members on llama-cpp-python in this process (member.py over
runner.py), the health check of this CPU and build (health.py, probe.py) and loading (load.py)."""
