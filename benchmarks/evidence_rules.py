"""Which evidence in a few-shot prompt tells which member knows the task? An offline study over
many shot sets per suite task.

For every task and every shot set (consecutive triples of the task's lines), each member runs one
forward per test example over `instruction + shots + "Q: x\\nA: target\\n"` and yields:
- evidence features of the shown answers (the shots), read from the answer rows exactly as the
  engine reads them (`evidence.answer_spans`, `answer_positions`);
- whether greedy decoding would write the target (teacher-forced: every token of " target\\n" is
  the member's top-1 given the ones before it; the same test as exact match for greedy decoding
  with the canonical tokenization).
A rule picks, per shot set, the member with the larger feature; its score is that member's
teacher-forced accuracy there. Rules are compared with each member alone and the oracle per shot
set, and the rule is chosen leave-one-task-out (chosen on six tasks, scored on the seventh).

    python benchmarks/evidence_rules.py --shot-sets 8 --examples 40 --out benchmarks/results/evidence_rules
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from ensemble_llm import Ensemble
from ensemble_llm.bench import INSTRUCTIONS, SUITE
from ensemble_llm.evidence import answer_spans, span_positions

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "bigbench"


def logprob_rows(m, h: torch.Tensor) -> torch.Tensor:
    """log-softmax of the member's output head over hidden states `h` (rows x d)."""
    logits = m.model.get_output_embeddings()(h).float()
    cap = getattr(m.model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return torch.log_softmax(logits, dim=-1)


def positions(m, text: str, spans):
    """The text's prompt ids, and per span the positions of the tokens that end inside it."""
    ids = m.prompt_ids(text)
    toks, ends = m.encode_with_offsets(text)
    offset = len(ids) - len(toks)
    assert list(ids[offset:]) == toks
    return ids, [span_positions(ends, [s], offset) for s in spans]


def read(logp, row_of, ids, ps, nbytes):
    lp = [float(logp[row_of[p], ids[p]]) for p in ps]
    hit = [int(logp[row_of[p]].argmax()) == ids[p] for p in ps]
    return lp, hit, nbytes


def study(m, shots: str, prompts: list[str], texts: list[str], batch: int = 8):
    """(shot answers' rows, per text whether its answer is the member's greedy continuation).
    The shots are prefilled once; each batch of test suffixes runs on a copy of that cache."""
    spans = answer_spans(prompts[0])
    pids, pps = positions(m, prompts[0], spans)
    sids = m.prompt_ids(shots)
    assert pids[: len(sids)] == sids and all(p < len(sids) for ps in pps for p in ps)
    x = torch.tensor([sids], dtype=torch.long, device=m.device)
    with torch.inference_mode():
        out = m.model(input_ids=x, use_cache=True, output_hidden_states=True, logits_to_keep=1)
        cache, hs = out.past_key_values, out.hidden_states[-1][0]
        rows = sorted({p - 1 for ps in pps for p in ps})
        logp = logprob_rows(m, hs[rows])
        row_of = {r + 1: i for i, r in enumerate(rows)}
        shot_rows = [read(logp, row_of, pids, ps, b1 - b0) for (b0, b1), ps in zip(spans, pps)]
        greedy = []
        for b in range(0, len(texts), batch):
            chunk = []
            for prompt, text in zip(prompts[b : b + batch], texts[b : b + batch]):
                ids, (ps,) = positions(m, text, [(len(prompt.encode()), len(text.encode()))])
                assert ids[: len(sids)] == sids and ps[0] >= len(sids)
                chunk.append((ids, ps))
            width = max(len(ids) for ids, _ in chunk) - len(sids)
            xs = torch.zeros(len(chunk), width, dtype=torch.long, device=m.device)
            mask = torch.zeros(len(chunk), len(sids) + width, dtype=torch.long, device=m.device)
            mask[:, : len(sids)] = 1
            for i, (ids, _) in enumerate(chunk):
                xs[i, : len(ids) - len(sids)] = torch.tensor(ids[len(sids) :])
                mask[i, len(sids) : len(ids)] = 1
            c = copy.deepcopy(cache)
            c.batch_repeat_interleave(len(chunk))
            h = m.model(
                input_ids=xs,
                attention_mask=mask,
                past_key_values=c,
                use_cache=True,
                output_hidden_states=True,
                logits_to_keep=1,
            ).hidden_states[-1]
            for i, (ids, ps) in enumerate(chunk):
                rs = [p - 1 - len(sids) for p in ps]
                lp = logprob_rows(m, h[i, rs])
                greedy.append(all(int(lp[k].argmax()) == ids[p] for k, p in enumerate(ps)))
    return shot_rows, greedy


def check_study(m, shots: str, prompts: list[str], texts: list[str]) -> None:
    """The cached, batched path against plain forwards with all logits (exactness of the study)."""
    shot_rows, greedy = study(m, shots, prompts, texts)
    for prompt, text, g in zip(prompts, texts, greedy):
        ids, pps = positions(m, text, answer_spans(prompt) + [(len(prompt.encode()), len(text.encode()))])
        with torch.inference_mode():
            ref = torch.log_softmax(m.model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
        assert g == all(int(ref[p - 1].argmax()) == ids[p] for p in pps[-1]), (m.name, text)
        for (lp, _, _), ps in zip(shot_rows, pps[:-1]):
            want = [float(ref[p - 1, ids[p]]) for p in ps]
            assert max(abs(u - v) for u, v in zip(lp, want)) < 1e-3, (m.name, lp, want)


def features(shots) -> dict[str, float]:
    lps = [sum(lp) for lp, _, _ in shots]
    hits = [h for _, hs, _ in shots for h in hs]
    nbytes = sum(b for _, _, b in shots)
    return {
        "logprob_per_answer": sum(lps) / len(lps),  # the engine's evidence today
        "logprob_per_byte": sum(lps) / nbytes,
        "top1_rate": sum(hits) / len(hits),  # answer tokens the member would have written greedily
        "answers_greedy": sum(all(hs) for _, hs, _ in shots) / len(shots),
        "logprob_first_token": sum(lp[0] for lp, _, _ in shots) / len(shots),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shot-sets", type=int, default=8)
    ap.add_argument("--examples", type=int, default=40)
    ap.add_argument("--tasks", nargs="*", default=list(SUITE))
    ap.add_argument("--out", default="evidence-rules")
    args = ap.parse_args()
    eng = Ensemble(method="unite", progress=False).load()
    names = [m.name for m in eng.members]
    t0 = time.time()
    sets = []
    for task in args.tasks:
        lines = [json.loads(x) for x in (DATA / f"{task}_dev.jsonl").read_text().splitlines() if x.strip()]
        tests = lines[3 * args.shot_sets : 3 * args.shot_sets + args.examples]
        for s in range(args.shot_sets):
            shots = (
                INSTRUCTIONS[task]
                + "\n\n"
                + "".join(f"Q: {x['input'].strip()}\nA: {x['targets'][0]}\n" for x in lines[3 * s : 3 * s + 3])
            )
            feats, acc = [], []
            prompts = [shots + f"Q: {ex['input'].strip()}\nA:" for ex in tests]
            texts = [p + f" {ex['targets'][0]}\n" for p, ex in zip(prompts, tests)]
            for m in eng.members:
                if s == 0 and task == args.tasks[0]:
                    check_study(m, shots, prompts[:4], texts[:4])
                shot_rows, greedy = study(m, shots, prompts, texts)
                feats.append(features(shot_rows))
                acc.append(sum(greedy))
            sets.append({"task": task, "shot_set": s, "correct": acc, "features": feats})
            print(task, s, acc, {k: [round(f[k], 3) for f in feats] for k in feats[0]}, flush=True)
    rules = list(sets[0]["features"][0])
    by_task = {t: [r for r in sets if r["task"] == t] for t in args.tasks}

    def score(rule: str | None, rs) -> int:
        tot = 0
        for r in rs:
            if rule is None:
                tot += max(r["correct"])
                continue
            f = [x[rule] for x in r["features"]]
            tot += r["correct"][max(range(len(f)), key=lambda i: (f[i], -i))]
        return tot

    table = {rule: {t: score(rule, rs) for t, rs in by_task.items()} for rule in rules}
    members = {n: {t: sum(r["correct"][i] for r in rs) for t, rs in by_task.items()} for i, n in enumerate(names)}
    oracle = {t: score(None, rs) for t, rs in by_task.items()}
    loto = {}
    for t in args.tasks:
        best = max(rules, key=lambda rule: sum(v for k, v in table[rule].items() if k != t))
        loto[t] = (best, table[best][t])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps({"members": names, "shot_sets": args.shot_sets, "examples": args.examples, "sets": sets}, indent=1)
    )
    n = args.examples * args.shot_sets
    head = "| rule | " + " | ".join(args.tasks) + " | pooled |"
    lines = [
        f"# Evidence rules: {args.shot_sets} shot sets x {args.examples} examples per task ({n} each), "
        "teacher-forced greedy exact match",
        "",
        head,
        "|---" * (len(args.tasks) + 2) + "|",
    ]

    def row(label, d):
        return f"| {label} | " + " | ".join(str(d[t]) for t in args.tasks) + f" | {sum(d.values())} |"

    for nme, d in members.items():
        lines.append(row(f"{nme} alone", d))
    for rule in rules:
        lines.append(row(f"router by {rule}", table[rule]))
    lines.append(row("oracle per shot set", oracle))
    lines.append(row("rule chosen leave-one-task-out", {t: v for t, (_, v) in loto.items()}))
    lines += [
        "",
        "Leave-one-task-out choices: " + ", ".join(f"{t}: {r}" for t, (r, _) in loto.items()),
        "",
        f"Wall time {time.time() - t0:.0f} s. Command: `python benchmarks/evidence_rules.py "
        f"--shot-sets {args.shot_sets} --examples {args.examples} --out {args.out}`",
    ]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
