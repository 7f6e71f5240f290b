import torch

from ensemble_llm.members.rows import pick_token


def test_greedy_is_argmax():
    lp = torch.log_softmax(torch.tensor([0.1, 2.0, 1.9, -1.0]), -1)
    assert pick_token(lp, 0.0) == 1


def test_top_p_samples_only_from_the_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    lp = probs.log()
    g = torch.Generator().manual_seed(0)
    seen = {pick_token(lp, 1.0, 0.8, g) for _ in range(400)}
    # brute force: the smallest set of top tokens whose mass reaches 0.8 is {0, 1}
    assert seen == {0, 1}


def test_sampling_frequencies_follow_temperature_scaled_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    g = torch.Generator().manual_seed(1)
    n = 6000
    counts = torch.bincount(torch.tensor([pick_token(probs.log(), 1.0, 1.0, g) for _ in range(n)]), minlength=3)
    assert torch.allclose(counts / n, probs, atol=0.03)
    t = 0.5
    want = torch.softmax(probs.log() / t, -1)
    counts = torch.bincount(torch.tensor([pick_token(probs.log(), t, 1.0, g) for _ in range(n)]), minlength=3)
    assert torch.allclose(counts / n, want, atol=0.03)


def test_seeded_sampling_is_reproducible():
    lp = torch.log_softmax(torch.randn(50, generator=torch.Generator().manual_seed(3)), -1)
    a = [pick_token(lp, 0.9, 0.95, torch.Generator().manual_seed(7)) for _ in range(5)]
    b = [pick_token(lp, 0.9, 0.95, torch.Generator().manual_seed(7)) for _ in range(5)]
    assert a == b
