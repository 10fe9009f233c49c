"""Write the shipped preference demonstration: arithmetic questions whose chosen answer is
right and whose rejected answer is a near miss, in TRL's conversational preference format.

    python scripts/make_preference_demo.py [--out data/demo/arithmetic_pairs.jsonl] [--n 480] [--seed 0]

The file is deterministic for a seed; the one in the repository is this script's default output.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "data" / "demo" / "arithmetic_pairs.jsonl"


def questions(n: int, seed: int) -> list[tuple[str, int, int]]:
    """``n`` arithmetic questions: ``(question, right answer, a near miss)`` (the GRPO demo's too)."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--n", type=int, default=480)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in pairs(args.n, args.seed)))
    print(f"wrote {args.n} pairs to {args.out}")


if __name__ == "__main__":
    main()
