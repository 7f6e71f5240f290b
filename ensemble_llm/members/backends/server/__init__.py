"""The server backend: a member whose model runs in a llama.cpp server (`llama-server`) that
this process reaches over HTTP (member.py), loaded through the registry (members/backends/__init__.py)."""
