"""The transformers backend: members on transformers in this process (member.py), their batched
executor (rowgroups.py), CPU head products (headpad.py) and loading (load.py)."""
