"""Write the shipped preference demonstrations: arithmetic questions whose chosen answer is
right and whose rejected answer is a near miss, in TRL's conversational preference format; with
``--unpaired``, TRL's unpaired format for KTO: each question once, with its right answer
(``label`` true) or its near miss (false), at random.

    python scripts/make_preference_demo.py [--out data/demo/arithmetic_pairs.jsonl] [--n 480] [--seed 0]
    python scripts/make_preference_demo.py --unpaired   # data/demo/arithmetic_kto.jsonl

The files are deterministic for a seed; the ones in the repository are this script's default outputs.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DEMO = Path(__file__).resolve().parent.parent / "data" / "demo"


def questions(n: int, seed: int) -> list[tuple[str, int, int]]:
    """``n`` arithmetic questions: ``(question, right answer, a near miss)``."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        op = rng.choice("+-")
        right = a + b if op == "+" else a - b
        wrong = right + rng.choice([-10, -2, -1, 1, 2, 10])
        out.append((f"What is {a} {op} {b}? Answer with the number only.", right, wrong))
    return out


def pairs(n: int, seed: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": question}],
             "chosen": [{"role": "assistant", "content": str(right)}],
             "rejected": [{"role": "assistant", "content": str(wrong)}]}
            for question, right, wrong in questions(n, seed)]


def unpaired(n: int, seed: int) -> list[dict]:
    """``pairs(n, seed)``'s questions, each with one of its two answers (a second seeded draw)."""
    rng = random.Random(seed + 1)
    rows = []
    for pair in pairs(n, seed):
        good = rng.random() < 0.5
        rows.append({"prompt": pair["prompt"], "completion": pair["chosen" if good else "rejected"], "label": good})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--n", type=int, default=480)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--unpaired", action="store_true", help="KTO's prompt/completion/label rows")
    args = parser.parse_args()
    out = args.out or DEMO / ("arithmetic_kto.jsonl" if args.unpaired else "arithmetic_pairs.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = (unpaired if args.unpaired else pairs)(args.n, args.seed)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {args.n} {'examples' if args.unpaired else 'pairs'} to {out}")


if __name__ == "__main__":
    main()
