"""Write jaxformer/data/corpora/preference_tasks.jsonl: preference pairs on the instruction tasks' strings.

Deterministic (a fixed seed): rerunning it rewrites the same file. The four tasks of
scripts/make_instruct_tasks.py (reverse, upper-case, sort the letters, the first letter) on new words;
each pair's chosen completion is the right answer and its rejected one the answer of a model that
did not do the task: the word copied as it came (for the first letter: its last letter; where that
is the answer itself, as for a palindrome's reverse, the answer's letters shuffled). One
record in ten is conversational (TRL's form: `prompt` a list of messages with a system turn,
`chosen` and `rejected` one assistant message each).

    python scripts/make_preference_pairs.py
"""

import json
import pathlib
import random

OUT = pathlib.Path(__file__).parent.parent / "jaxformer" / "data" / "corpora" / "preference_tasks.jsonl"
TASKS = {
    "Reverse": lambda w: w[::-1],
    "Upper": str.upper,
    "Sort": lambda w: "".join(sorted(w)),
    "First letter of": lambda w: w[0],
}


def near_miss(rng: random.Random, word: str, answer: str) -> str:
    """A wrong answer a weak model gives: the word copied as it came (the task not done); for the first
    letter, the last one; where that is the answer itself, the answer's letters in another order."""
    if len(answer) == 1:
        return word[-1] if word[-1] != answer else rng.choice([c for c in word if c != answer])
    if word != answer:
        return word
    letters = list(answer)
    while "".join(letters) == answer:
        rng.shuffle(letters)
    return "".join(letters)


def main(n: int = 1200, seed: int = 1) -> None:
    rng = random.Random(seed)
    lines = []
    while len(lines) < n:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 6)))
        task = rng.choice(sorted(TASKS))
        answer = TASKS[task](word)
        if len(set(word)) == 1 or (len(answer) > 1 and len(set(answer)) == 1):
            continue  # no other order or letter to reject
        prompt, rejected = f"{task}: {word}", near_miss(rng, word, answer)
        if len(lines) % 10 == 9:
            turns = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": prompt}]
            said = lambda text: [{"role": "assistant", "content": text}]
            lines.append(json.dumps({"prompt": turns, "chosen": said(answer), "rejected": said(rejected)}))
        else:
            lines.append(json.dumps({"prompt": prompt, "chosen": answer, "rejected": rejected}))
    OUT.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
