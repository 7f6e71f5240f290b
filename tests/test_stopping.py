import random

import pytest

from ensemble_llm.stopping import StopMatcher


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
