"""The formats set (issue 71): prompts in the shapes LangChain and LlamaIndex users send, drawn
from public data, fixed and split before any ensemble ran on them.

Twelve tasks of four kinds, chosen before any model ran on them (no task is added later):
- facts: capital_of, element_of_symbol, country_currency (countryinfo, periodictable, babel);
- word forms: en_comparative, en_irregular_past, en_plural (lemminflect over wordfreq's list);
- arithmetic: add2, sub2, mul (seeded draws);
- classification: parity, continent (countryinfo's region), larger_of (seeded draws).

Each item is asked five ways:
- `qa`: three shots `Q: x / A: y`, then `Q: x / A:`;
- `arrow`: GPT-3's style, `x => y` lines, then `x =>`;
- `nextline`: `Question: x / Answer:` with the answer on the next line;
- `turns`: the shots as earlier chat turns (user x, assistant y), then the user's x;
- `chat`: zero-shot, one user message, the question in words (`ASK`).
Few-shot replies are right when their first line is a target (case and a final period aside);
chat replies by `chat_right` (a target as a whole word; for a classification, the first option
named is the target).

RAG: 120+ questions through LlamaIndex's query engine (`SummaryIndex`, its default text-QA
prompt) over three country documents, one holding the answer, written from countryinfo's real
records (capital, region, population, area, currencies, languages, calling codes, domain,
borders). The fields asked are ones a small model does not know by heart.

The split: each item goes to `tune` or `outside` by a salted hash of its task and input (the SALT
below, committed before any ensemble ran on the set). Choices are made on `tune` and the dev
suite; `outside` is scored once, per final candidate.

    pip install lemminflect==0.2.3 wordfreq==3.1.1 babel==2.19.0 countryinfo==1.0.1 periodictable==2.1.0
    python benchmarks/formats_set.py --out benchmarks/results/formats_set   # writes set.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import floor_tasks as ft  # noqa: E402

SALT = "ensemble_llm-formats-2026-12-07"
SHOTS = 3
PER_TASK = {"tune": 12, "outside": 20}  # items per task and half (every format asks the same items)
RAG_PER_HALF = {"tune": 40, "outside": 120}
FORMATS = ("qa", "arrow", "nextline", "turns", "chat")
KINDS = {
    "capital_of": "facts",
    "element_of_symbol": "facts",
    "country_currency": "facts",
    "en_comparative": "word forms",
    "en_irregular_past": "word forms",
    "en_plural": "word forms",
    "add2": "arithmetic",
    "sub2": "arithmetic",
    "mul": "arithmetic",
    "parity": "classification",
    "continent": "classification",
    "larger_of": "classification",
}
# zero-shot chat: the question in words
ASK = {
    "capital_of": "What is the capital of {x}?",
    "element_of_symbol": "Which chemical element has the symbol {x}?",
    "country_currency": "What is the currency of {x}?",
    "en_comparative": 'What is the comparative form of the adjective "{x}"?',
    "en_irregular_past": 'What is the past tense of the verb "{x}"?',
    "en_plural": 'What is the plural of the noun "{x}"?',
    "add2": "What is {x}?",
    "sub2": "What is {x}?",
    "mul": "What is {x}?",
    "parity": "Is {x} an even or an odd number?",
    "continent": "On which continent is {x}?",
    "larger_of": "Which number is larger: {x}?",
}
REGIONS = {"Africa": "Africa", "Americas": "America", "Asia": "Asia", "Europe": "Europe", "Oceania": "Oceania"}


def digest(text: str) -> int:
    return int(hashlib.sha256(f"{SALT}:{text}".encode()).hexdigest()[:12], 16)


def _arith(name: str) -> list[tuple[str, str, list[str] | None]]:
    rng = random.Random(f"{SALT}:{name}")
    out = []
    for _ in range(400):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if name == "add2":
            out.append((f"{a} + {b}", str(a + b), None))
        elif name == "sub2":
            a, b = max(a, b), min(a, b)
            out.append((f"{a} - {b}", str(a - b), None))
        elif name == "mul":
            a = rng.randint(2, 9)
            out.append((f"{a} * {b}", str(a * b), None))
        elif name == "parity":
            n = rng.randint(100, 999)
            out.append((str(n), "even" if n % 2 == 0 else "odd", ["even", "odd"]))
        elif a != b:  # larger_of
            out.append((f"{a} or {b}", str(max(a, b)), [str(a), str(b)]))
    return out


def _continents() -> list[tuple[str, str, list[str]]]:
    from countryinfo import CountryInfo

    out = []
    for _, info in sorted(CountryInfo.all().items()):
        region, name = info.get("region"), info.get("name")
        if region in REGIONS and isinstance(name, str):
            out.append((name, REGIONS[region], sorted(REGIONS.values())))
    return out


def pairs(task: str) -> list[tuple[str, str, list[str] | None]]:
    """(input, target, options or None) for a task, from its public source."""
    plain = {
        "capital_of": lambda: ft._capitals(False),
        "element_of_symbol": lambda: [(b, a) for a, b in ft._elements()],
        "country_currency": ft._country_currency,
        "en_comparative": lambda: ft._english("ADJ", "JJR"),
        "en_irregular_past": ft._irregular_past,
        "en_plural": lambda: ft._english("NOUN", "NNS"),
    }
    if task in plain:
        return [(q, a, None) for q, a in dict(plain[task]()).items() if q and a]
    if task == "continent":
        return _continents()
    return _arith(task)


def task_items(task: str) -> dict[str, list[dict]]:
    """The task's items per half: the first PER_TASK[half] by the salted hash, each with three
    shots drawn (fixed seed) from the task's other rows of the same half's pool."""
    rows = {q: (a, opts) for q, a, opts in pairs(task)}
    order = sorted(rows, key=lambda q: digest(f"{task}:{q}"))
    halves = {"tune": [q for q in order if digest(f"half:{task}:{q}") % 2 == 0]}
    halves["outside"] = [q for q in order if digest(f"half:{task}:{q}") % 2 == 1]
    out = {}
    for half, pool in halves.items():
        items = []
        for _i, q in enumerate(pool[: PER_TASK[half]]):
            rng = random.Random(f"{SALT}:{task}:{q}")
            shots = rng.sample([x for x in pool if x != q], SHOTS)
            a, opts = rows[q]
            items.append(
                {
                    "task": task,
                    "kind": KINDS[task],
                    "input": q,
                    "targets": [a],
                    "options": opts,
                    "shots": [{"input": s, "target": rows[s][0]} for s in shots],
                }
            )
        out[half] = items
    return out


def prompt(item: dict, fmt: str) -> str | list[dict]:
    """The item asked in a format (see the module doc)."""
    shots, q = item["shots"], item["input"]
    if fmt == "qa":
        return "".join(f"Q: {s['input']}\nA: {s['target']}\n" for s in shots) + f"Q: {q}\nA:"
    if fmt == "arrow":
        return "".join(f"{s['input']} => {s['target']}\n" for s in shots) + f"{q} =>"
    if fmt == "nextline":
        return (
            "".join(f"Question: {s['input']}\nAnswer:\n{s['target']}\n\n" for s in shots) + f"Question: {q}\nAnswer:\n"
        )
    if fmt == "turns":
        turns = [
            [{"role": "user", "content": s["input"]}, {"role": "assistant", "content": s["target"]}] for s in shots
        ]
        return [m for t in turns for m in t] + [{"role": "user", "content": q}]
    if fmt == "chat":
        return [{"role": "user", "content": ASK[item["task"]].format(x=q)}]
    raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")


def _norm(s: str) -> str:
    first = s.strip().splitlines()[0].strip() if s.strip() else ""
    return re.sub(r"\.$", "", first).lower()


def _words(text: str, target: str) -> list[int]:
    return [m.start() for m in re.finditer(rf"(?<![\w.]){re.escape(target.lower())}(?![\w]|\.\d)", text.lower())]


def chat_right(reply: str, item: dict) -> bool:
    """A chat reply is right when a target occurs in it as a whole word; for a classification, the
    first option it names must be the target."""
    opts = item.get("options")
    if opts:
        first = {o: min(_words(reply, o), default=10**9) for o in opts}
        best = min(first, key=first.get)
        return first[best] < 10**9 and best in item["targets"]
    return any(_words(reply, t) for t in item["targets"])


def right(reply: str, item: dict, fmt: str) -> bool:
    """Whether a reply to the item asked in `fmt` (or in RAG: fmt "rag") is right."""
    if fmt in ("chat", "rag"):
        return chat_right(reply, item)
    return _norm(reply) in {_norm(t) for t in item["targets"]}


# RAG: the fields asked of a country's document, as (question, how the document writes the value)
RAG_FIELDS = ("calling code", "domain", "population", "area", "currency code", "subregion")


def _country_doc(info: dict, names: dict) -> tuple[str, dict[str, list[str]]]:
    """A country's document from its countryinfo record, and each asked field's accepted answers."""
    pop, area = info.get("population"), info.get("area")
    codes, tld = info.get("callingCodes") or [], info.get("tld") or []
    cur = [c for c in info.get("currencies") or [] if isinstance(c, str)]
    langs = [names["lang"].get(c, c) for c in info.get("languages") or [] if isinstance(c, str)]
    borders = ", ".join(info.get("borders") or []) or "none"
    money = ", ".join(f"{names['cur'].get(c, c)} ({c})" for c in cur)
    text = (
        f"{info['name']} is a country in {info.get('subregion') or info['region']} ({info['region']}). "
        f"Its capital is {info.get('capital') or 'not listed'}. It has a population of {pop:,} and an area of "
        f"{area:,} square kilometres. Currency: {money}. "
        f"Languages: {', '.join(langs)}. International calling code: +{codes[0]}. "
        f"Internet domain: {tld[0]}. Land borders (ISO codes): {borders}."
    )
    answers = {
        "calling code": [f"+{codes[0]}", codes[0]],
        "domain": [tld[0]],
        "population": [f"{pop:,}", str(pop)],
        "area": [f"{area:,}", str(area)],
        "currency code": [cur[0]],
        "subregion": [info.get("subregion") or ""],
    }
    return text, answers


RAG_ASK = {
    "calling code": "What is the international calling code of {c}?",
    "domain": "What is the internet domain of {c}?",
    "population": "What is the population of {c}?",
    "area": "What is the area of {c} in square kilometres?",
    "currency code": "What is the currency code of {c}?",
    "subregion": "In which subregion of the world is {c}?",
}


def rag_items() -> dict[str, list[dict]]:
    """Per half, RAG questions: a field of one country, with that country's document and two
    others' (drawn with a fixed seed) as the index's documents."""
    from babel import Locale
    from countryinfo import CountryInfo

    names = {"lang": Locale("en").languages, "cur": Locale("en").currencies}
    docs = {}
    for _, info in sorted(CountryInfo.all().items()):
        try:
            ok = info["callingCodes"][0] and info["tld"][0] and info["currencies"] and info.get("subregion")
            docs[info["name"]] = _country_doc(info, names) if ok and info["population"] and info["area"] else None
        except (KeyError, IndexError, TypeError):
            continue
    docs = {k: v for k, v in docs.items() if v}
    keys = sorted(((c, f) for c in docs for f in RAG_FIELDS), key=lambda x: digest(f"rag:{x[0]}:{x[1]}"))
    out: dict[str, list[dict]] = {"tune": [], "outside": []}
    for c, f in keys:
        half = "tune" if digest(f"rag-half:{c}") % 2 == 0 else "outside"  # a country's fields stay together
        if len(out[half]) >= RAG_PER_HALF[half] or any(x["country"] == c for x in out[half][-3:]):
            continue
        rng = random.Random(f"{SALT}:rag:{c}:{f}")
        others = rng.sample(sorted(set(docs) - {c}), 2)
        texts = [docs[c][0]] + [docs[o][0] for o in others]
        rng.shuffle(texts)
        targets = [t for t in docs[c][1][f] if t]
        out[half].append(
            {
                "task": f"rag_{f.replace(' ', '_')}",
                "kind": "rag",
                "country": c,
                "input": RAG_ASK[f].format(c=c),
                "targets": targets,
                "options": None,
                "documents": texts,
            }
        )
    return out


def build() -> dict:
    """The whole set: per half, the few-shot / chat items of every task and the RAG items."""
    out: dict = {"salt": SALT, "formats": list(FORMATS), "tune": [], "outside": []}
    for task in KINDS:
        for half, items in task_items(task).items():
            out[half] += items
    for half, items in rag_items().items():
        out[f"rag_{half}"] = items
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "formats_set")
    args = ap.parse_args()
    data = build()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "set.json").write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    for half in ("tune", "outside"):
        print(half, len(data[half]), "items x", len(FORMATS), "formats;", len(data[f"rag_{half}"]), "RAG questions")


if __name__ == "__main__":
    main()
