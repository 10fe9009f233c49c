"""Write the shipped verifiable-reward demonstration: arithmetic questions (the preference
demo's task) as conversational prompts with their answer, for ``--objective grpo`` with the
built-in ``exact_answer`` reward.

    python scripts/make_grpo_demo.py [--out data/demo/arithmetic_prompts.jsonl] [--n 480] [--seed 1]

The file is deterministic for a seed; the one in the repository is this script's default output
(seed 1: other questions than the preference pairs').
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from make_preference_demo import questions  # (scripts/ is on sys.path when this runs)

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "data" / "demo" / "arithmetic_prompts.jsonl"


def prompts(n: int, seed: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": question}], "answer": str(right)}
            for question, right, _ in questions(n, seed)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--n", type=int, default=480)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in prompts(args.n, args.seed)))
    print(f"wrote {args.n} prompts to {args.out}")


if __name__ == "__main__":
    main()
