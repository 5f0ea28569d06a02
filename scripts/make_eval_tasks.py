"""Write the shipped lm-eval tasks' data (jaxformer/evaluation/tasks/*.jsonl) from the shipped corpora.

Deterministic (a fixed seed): rerunning it rewrites the same files. Small on purpose (a task runs in
seconds on a CPU); each file is read offline by its task YAML beside it.

- shakespeare_cloze: a line of verse and four candidates for the line after it (the true one and three
  lines from elsewhere in the plays); multiple choice, accuracy.
- instruct_exact: the instruction tasks' prompt/response records (reverse, upper-case, sort, first
  letter); greedy generation to the end of the line, exact match.
- lohelp_en_de: short English-German pairs of the LibreOffice help; greedy generation, BLEU.

    python scripts/make_eval_tasks.py
"""

import csv
import io
import itertools
import json
import lzma
import pathlib
import random

ROOT = pathlib.Path(__file__).parent.parent / "jaxformer"
CORPORA, OUT = ROOT / "data" / "corpora", ROOT / "evaluation" / "tasks"


def verse_lines() -> list[str]:
    """The plays' lines of 5-12 words that end no speech (so a line follows), in order."""
    text = lzma.decompress((CORPORA / "shakespeare.txt.xz").read_bytes()).decode("utf-8")
    lines = [line.strip() for line in text.splitlines()]
    pairs = []
    for a, b in itertools.pairwise(lines):
        ok = lambda s: 5 <= len(s.split()) <= 12 and not s.isupper() and not s.startswith("[")
        if ok(a) and ok(b):
            pairs.append((a, b))
    return pairs


def shakespeare_cloze(rng: random.Random, n: int) -> list[dict]:
    pairs = verse_lines()
    picked = rng.sample(range(len(pairs)), n)
    docs = []
    for i in picked:
        context, truth = pairs[i]
        others = [pairs[j][1] for j in rng.sample(range(len(pairs)), 3)]
        choices = [truth, *others]
        rng.shuffle(choices)
        docs.append({"context": context, "choices": choices, "answer": choices.index(truth)})
    return docs


def instruct_exact(rng: random.Random, n: int) -> list[dict]:
    records = [json.loads(line) for line in (CORPORA / "instruct_tasks.jsonl").read_text().splitlines()]
    records = [r for r in records if "prompt" in r]
    return [{"prompt": r["prompt"], "response": r["response"]} for r in rng.sample(records, n)]


def lohelp_en_de(rng: random.Random, n: int) -> list[dict]:
    text = lzma.decompress((CORPORA / "en_de_lohelp.tsv.xz").read_bytes()).decode("utf-8")
    rows = list(csv.DictReader(io.StringIO(text), delimiter="\t", quoting=csv.QUOTE_NONE))
    short = [r for r in rows if 3 <= len(r["en"].split()) <= 10 and "\n" not in r["en"] + r["de"]]
    return [{"en": r["en"], "de": r["de"]} for r in rng.sample(short, n)]


def main(seed: int = 0) -> None:
    for make, n in ((shakespeare_cloze, 64), (instruct_exact, 64), (lohelp_en_de, 32)):
        docs = make(random.Random(seed), n)
        lines = [json.dumps(d, ensure_ascii=False) for d in docs]
        (OUT / f"{make.__name__}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
