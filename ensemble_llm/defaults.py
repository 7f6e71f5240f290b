"""One set of defaults, read by the engine, the CLI, serve and both facades (tests/test_defaults.py
checks that they agree). Floor 0: imports nothing, so the CLI's --help reads it without torch."""

# the method for 2+ members: `auto`, specfuse for raw prompts and safe for chat messages
# (methods/auto.py; docs/methods.md gives the measurements behind it); one member runs `single`.
# The members when none are named: members/registry.py DEFAULT_MODELS
ENSEMBLE_METHOD = "auto"
ONE_MEMBER_METHOD = "single"

# a reply's budget in the main member's tokens: a chat or RAG answer of a few paragraphs
MAX_NEW_TOKENS = 256
TEMPERATURE = 0.0  # greedy: the same prompt gives the same answer
TOP_P = 1.0


def method_for(n_members: int) -> str:
    """The default method for an ensemble of `n_members`."""
    return ENSEMBLE_METHOD if n_members > 1 else ONE_MEMBER_METHOD
