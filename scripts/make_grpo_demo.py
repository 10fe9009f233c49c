"""Write the shipped verifiable-reward demonstration: every single-digit sum and difference
(``a + b`` and, for ``a >= b``, ``a - b``, with ``a, b`` in 0..9: 155 distinct questions, each
once, shuffled) as conversational prompts with their answer, for ``--objective grpo`` with the
built-in ``exact_answer`` reward.

    python scripts/make_grpo_demo.py [--out data/demo/arithmetic_prompts.jsonl] [--seed 1]

The task is sized to the default model (SmolLM2-135M-Instruct): it answers some of these
questions and not others, and at temperature 1 the completions of one question often differ in
whether they state the right number within a few tokens, so a group's rewards differ and its
advantages are not zero. Each question appears once, so a held-out split holds questions the
run never trains on. The file is deterministic for a seed; the one in the repository is this
script's default output.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "data" / "demo" / "arithmetic_prompts.jsonl"


def questions(seed: int) -> list[tuple[str, int]]:
    """Every single-digit sum and non-negative difference, ``(question, answer)``, shuffled."""
    out = [(f"What is {a} + {b}? Answer with the number only.", a + b) for a in range(10) for b in range(10)]
    out += [(f"What is {a} - {b}? Answer with the number only.", a - b) for a in range(10) for b in range(a + 1)]
    random.Random(seed).shuffle(out)
    return out


def prompts(seed: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": question}], "answer": str(answer)}
            for question, answer in questions(seed)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rows = prompts(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts to {args.out}")


if __name__ == "__main__":
    main()
