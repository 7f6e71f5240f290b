import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ensemble_llm.methods.text import Utf8Releaser
from ensemble_llm.stopping import StopMatcher, StopPolicy


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    cuts = [text.find(s) for s in stops if s and s in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


def run(chunks, stops):
    m = StopMatcher(stops)
    out = []
    for c in chunks:
        out.append(m.feed(c))
        if m.stopped:
            break
    out.append(m.flush())
    return out, m.stopped


@pytest.mark.parametrize("seed", range(300))
def test_matches_reference_on_random_chunkings(seed):
    rng = random.Random(seed)
    alphabet = "ab\nX"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 8))))
    chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    out, stopped = run(chunks, stops)
    want, want_stopped = reference(text, stops)
    assert "".join(out) == want
    assert stopped == want_stopped
    # nothing released is ever taken back, and no released prefix contains a stop string
    released = ""
    for piece in out:
        released += piece
        assert not any(s in released for s in stops)


def test_multi_token_stop_is_held_back_then_released():
    m = StopMatcher(["\nUser:"])
    assert m.feed("Paris.\nUs") == "Paris."
    assert m.feed("ually") == "\nUsually"
    assert m.feed(" more\nUser: hi") == " more"
    assert m.stopped


def test_no_stops_passes_through():
    m = StopMatcher([])
    assert m.feed("abc") == "abc"
    assert m.flush() == ""


@given(
    data=st.binary(max_size=12).map(lambda b: bytes(c % 3 + 97 for c in b)),
    stops=st.lists(st.text("abc", max_size=3), max_size=4),
    since=st.integers(0, 12),
)
def test_stop_policy_end_is_the_first_stop_end_after_since(data, stops, since):
    """StopPolicy.end against brute force: the smallest end of any stop occurrence ending after `since`."""
    policy = StopPolicy(tuple(stops))
    ends = [
        i + len(s)
        for s in stops
        if s
        for i in range(len(data) - len(s.encode()) + 1)
        if data[i:].startswith(s.encode()) and i + len(s) > since
    ]
    assert policy.end(data, since) == (min(ends) if ends else None)
    cut = policy.cut_suffix(data)
    enders = [s for s in stops if s and data.endswith(s.encode())]
    assert cut == (data[: -len(max(enders, key=len))] if enders else None)
    assert policy.strings == tuple(s for s in dict.fromkeys(stops) if s)


# ---- UTF-8 release of decided bytes (methods/text.py) ---------------------------------------
@given(data=st.binary(max_size=24) | st.text(max_size=8).map(str.encode), cuts=st.lists(st.integers(0, 24), max_size=5))
def test_utf8_releaser_deltas_are_final_and_add_up_to_the_text(data, cuts):
    """However the committed bytes grow, the deltas concatenate to the bytes decoded (invalid ones
    as U+FFFD), with no trailing U+FFFD for undecodable last bytes, and no delta is ever revised."""
    rel, out = Utf8Releaser(), []
    for c in sorted(cuts):
        out.append(rel.take(data[:c]))
    out.append(rel.take(data, final=True))
    whole = data.decode("utf-8", errors="replace")
    expected = whole if data.endswith("\ufffd".encode()) else whole.rstrip("\ufffd")
    assert "".join(out) == expected
    for piece in out[:-1]:  # streamed pieces hold only complete, valid text
        assert "\ufffd" not in piece or "\ufffd".encode() in data
