"""The server backend: a member whose model runs in a llama.cpp server (`llama-server`) that
this process reaches over HTTP (member.py), loaded through members/backends.py."""
