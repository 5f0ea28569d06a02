"""Write jaxformer/data/corpora/instruct_tasks.jsonl: small string tasks a tiny model learns on a CPU.

Deterministic (a fixed seed): rerunning it rewrites the same file. Four tasks on words of 3-6
lowercase letters (reverse, upper-case, sort the letters, the first letter) as prompt/response
records, and one record in ten in the chat form (`messages`, with a system turn).

    python scripts/make_instruct_tasks.py
"""

import json
import pathlib
import random

OUT = pathlib.Path(__file__).parent.parent / "jaxformer" / "data" / "corpora" / "instruct_tasks.jsonl"
TASKS = {
    "Reverse": lambda w: w[::-1],
    "Upper": str.upper,
    "Sort": lambda w: "".join(sorted(w)),
    "First letter of": lambda w: w[0],
}


def main(n: int = 600, seed: int = 0) -> None:
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 6)))
        task = rng.choice(sorted(TASKS))
        prompt, response = f"{task}: {word}", TASKS[task](word)
        if i % 10 == 9:
            system = {"role": "system", "content": "Answer in one word."}
            turns = [system, {"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            lines.append(json.dumps({"messages": turns}))
        else:
            lines.append(json.dumps({"prompt": prompt, "response": response}))
    OUT.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
