"""Picking a token from log-probs: greedy, temperature and nucleus (top-p) sampling."""

from __future__ import annotations

import torch


def pick_token(logprobs: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
               generator: torch.Generator | None = None) -> int:
    """argmax when temperature == 0, else a sample from softmax(logprobs / T) cut to top_p mass.
    A remote row (a member in a Ray actor) picks on its actor, with a seed drawn from `generator`."""
    if not isinstance(logprobs, torch.Tensor):
        return logprobs.pick(temperature, top_p, generator)
    if temperature <= 0.0:
        return int(torch.argmax(logprobs))
    logits = logprobs.float() / temperature
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        keep = cum - sorted_p < top_p  # smallest prefix reaching top_p (always keeps the first)
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        idx = torch.multinomial(sorted_p.cpu(), 1, generator=generator)
        return int(order[idx.to(order.device)])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
