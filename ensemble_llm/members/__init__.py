"""Members: one loaded causal LM each, and the token-level API the methods use."""

from .backends.transformers.member import KVState, Member
from .loader import Source, clear_cache, load_member, resolve_device, resolve_dtype, resolve_source
from .options import MemberOptions, member_options
from .plan import MemoryPlan, plan_members
from .protocol import PromptScore, TokenLM
from .registry import BUNDLED, DEFAULT_MODELS

__all__ = [
    "BUNDLED",
    "DEFAULT_MODELS",
    "KVState",
    "Member",
    "MemberOptions",
    "MemoryPlan",
    "PromptScore",
    "Source",
    "TokenLM",
    "clear_cache",
    "load_member",
    "member_options",
    "plan_members",
    "resolve_device",
    "resolve_dtype",
    "resolve_source",
]
