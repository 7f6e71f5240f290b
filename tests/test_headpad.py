"""The output layer padded to 16 rows where the CPU's library is slow at a few (members/headpad.py):
the same values as the plain product, for every row count and shape; the model's weights stay
tied; the rule that decides from timings; and the real Gemma-3 member's logits unchanged."""

from unittest import mock

import pytest
import torch
from torch import nn

from ensemble_llm.members import headpad
from ensemble_llm.members.headpad import ROWS, RowPadded, pad_rows


def _spy_rows():
    """Patch nn.functional.linear (what nn.Linear.forward calls) to record the rows it is given."""
    seen = []
    real = nn.functional.linear

    def linear(x, w, b=None):
        seen.append(x.numel() // x.shape[-1])
        return real(x, w, b)

    return seen, mock.patch("torch.nn.modules.linear.F.linear", linear)


@pytest.mark.parametrize("pad_from", [4, 7])
def test_padded_product_equals_the_plain_one_for_every_row_count_and_shape(pad_from):
    torch.manual_seed(0)
    plain = nn.Linear(24, 300, bias=True)
    padded = nn.Linear(24, 300, bias=True)
    padded.load_state_dict(plain.state_dict())
    padded.__class__, padded.pad_from = RowPadded, pad_from
    seen, patch = _spy_rows()
    for shape in [(n, 24) for n in range(1, 21)] + [(1, 9, 24), (2, 3, 24), (3, 1, 24), (1, 16, 24), (24,)]:
        x = torch.randn(*shape)
        want = nn.functional.linear(x, plain.weight, plain.bias)
        seen.clear()
        with patch:
            got = padded(x)
        n = x.numel() // 24
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert seen == [ROWS if pad_from <= n < ROWS else n], (shape, seen)


def test_pad_rows_keeps_the_tied_weight_and_the_models_logits(tiny_members):
    model = tiny_members["gemma"].model
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    assert head.weight is emb.weight  # Gemma ties them
    assert type(head) is nn.Linear  # 32 MB: too small to be timed or padded by default
    x = torch.tensor([[2, 10, 20, 30, 40, 50, 60, 70, 80]])
    with torch.inference_mode():
        want = model(input_ids=x).logits
    try:
        assert pad_rows(model, 4) == 4
        assert model.get_output_embeddings() is head and type(head) is RowPadded and head.weight is emb.weight
        seen, patch = _spy_rows()
        with torch.inference_mode(), patch:
            got = model(input_ids=x).logits
        assert ROWS in seen  # the 9 rows ran as 16
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert pad_rows(model) == 4  # already padded: as it is
    finally:
        assert pad_rows(model, None) is None
    assert type(head) is nn.Linear and head.weight is emb.weight


def test_pad_rows_leaves_small_quantized_and_non_cpu_heads_alone(tiny_members):
    model = tiny_members["smol"].model
    assert pad_rows(model) is None and type(model.get_output_embeddings()) is nn.Linear
    meta = nn.Module()
    meta.get_output_embeddings = lambda: nn.Linear(64, 1 << 20, bias=False, device="meta")
    assert pad_rows(meta, 4) is None  # not on the CPU
    half = nn.Module()
    q = nn.Linear(8, 8)
    q.weight = nn.Parameter(torch.zeros(8, 8, dtype=torch.int8), requires_grad=False)
    half.get_output_embeddings = lambda: q
    assert pad_rows(half, 4) is None and type(q) is nn.Linear  # not a float weight


@pytest.mark.parametrize(
    "times, want",
    [
        ({16: 0.060, 4: 0.058, 7: 0.086}, 7),  # MKL on a 2-core AVX-512 Xeon: 3 rows a pass below 16
        ({16: 0.060, 4: 0.070, 7: 0.090}, 4),
        ({16: 0.035, 4: 0.030, 7: 0.033}, None),  # a library without the slow path
    ],
)
def test_the_measured_rule(times, want, monkeypatch):
    monkeypatch.setattr(headpad, "_DECISIONS", {})
    monkeypatch.setattr(headpad, "_time", lambda head, rows: times[rows])
    head = nn.Linear(8, 8, bias=False)
    assert headpad.measure(head) == want
    monkeypatch.setattr(headpad, "_time", lambda head, rows: pytest.fail("timed twice"))
    assert headpad.measure(head) == want  # once per process and shape


@pytest.mark.real
def test_real_gemma_logits_are_those_of_the_plain_output_layer(real_dirs):
    from helpers import GEMMA

    from ensemble_llm.members import load_member

    m = load_member(real_dirs[GEMMA], device="cpu", dtype="float32")
    assert m.head_pad in (None, 4, 7)  # what this machine's timing chose
    ids = m.prompt_ids("Q: What is the capital of France?\nA: Paris\nQ: And of Italy?\nA:")
    x = torch.tensor([ids[:12]])
    before = m.head_pad
    try:
        pad_rows(m.model, None)
        with torch.inference_mode():
            want = m.model(input_ids=x).logits
        pad_rows(m.model, 4)
        with torch.inference_mode():
            got = m.model(input_ids=x).logits
    finally:
        pad_rows(m.model, before)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert got[0].argmax(-1).tolist() == want[0].argmax(-1).tolist()
