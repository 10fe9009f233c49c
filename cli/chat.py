"""``outcore chat``: talk with a model or a run's trained model, its answers streamed as they come."""
from __future__ import annotations

import argparse
import contextlib

from .generate import STREAMING_NOTE, add_model_arguments, add_sampling_arguments, open_generator

HELP = "chat with a model or a fine-tuning run's result (answers streamed)"
DESCRIPTION = f"""\
An interactive conversation through the model's chat template: each answer is
printed as it is generated and the conversation so far is the next prompt.
/exit (or Ctrl-D) leaves, /reset starts over, Ctrl-C stops the answer being
written (not the session). MODEL is anything `outcore finetune --model` takes
or a run directory (its final/ model, or its newest checkpoint).

{STREAMING_NOTE}

examples:
  outcore chat default
  outcore chat runs/default --temperature 0.7 --system "You speak like Hamlet."
"""
EXIT, RESET = ("/exit", "/quit"), "/reset"
YOU, MODEL = "you> ", "model> "


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the chat options on ``parser``."""
    add_model_arguments(parser)
    add_sampling_arguments(parser, max_new_tokens=256)
    parser.add_argument("--system", metavar="TEXT", default=None, help="a system message opening the conversation")


def _answer(generator, messages: list[dict], args: argparse.Namespace) -> str:
    """Stream one answer to the terminal; Ctrl-C ends it early. Returns the text written."""
    pieces: list[str] = []
    print(MODEL, end="", flush=True)
    # closing(): however the loop ends, the stream stops its worker after the token in progress
    stream = contextlib.closing(generator.stream(messages, max_new_tokens=args.max_new_tokens,
                                                 temperature=args.temperature, seed=args.seed, chat=True))
    try:
        with stream as texts:
            for piece in texts:
                print(piece, end="", flush=True)
                pieces.append(piece)
    except KeyboardInterrupt:
        print(" [stopped]", end="")
    print(flush=True)
    return "".join(pieces).strip()


def run(args: argparse.Namespace) -> int:
    """Load the model, then read messages and stream answers until /exit or end of input; return 0."""
    from ..errors import ConfigError

    try:
        import readline  # noqa: F401  (line editing and history for input(), where the platform has it)
    except ImportError:
        pass
    opening = [{"role": "system", "content": args.system}] if args.system else []
    with open_generator(args) as generator:
        if not generator.has_chat_template:
            raise ConfigError(f"{args.model!r} has no chat template; use `outcore generate --no-chat` "
                              "or a chat model")
        print(f"outcore chat: {args.model} (offload {generator.offload}). "
              f"{EXIT[0]} or Ctrl-D leaves, {RESET} starts over, Ctrl-C stops an answer.", flush=True)
        messages = list(opening)
        while True:
            try:
                text = input(YOU).strip()
            except EOFError:  # Ctrl-D, or the end of piped input
                print()
                break
            except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
                print()
                continue
            if text in EXIT:
                break
            if text == RESET:
                messages = list(opening)
                continue
            if not text:
                continue
            messages.append({"role": "user", "content": text})
            messages.append({"role": "assistant", "content": _answer(generator, messages, args)})
    return 0
