"""torchrun's elastic restarts: a launch whose ranks torchrun restarts (``--max-restarts N``)
continues its own run instead of refusing the directory it has just written.

When a rank fails, torchrun stops the others and, while restarts are left, starts the same
command again with ``TORCHELASTIC_RESTART_COUNT`` one higher. That command has no
``--resume`` (and the first attempt has written ``config.yaml``), so without this the
restarted ranks would stop at "output directory already holds a run". Here rank 0 records
which launch wrote the directory (:func:`mark_launch`); a restart of *that* launch continues
from the newest complete checkpoint, or starts over when the first attempt died before one
(:func:`continue_after_restart`). A directory another launch wrote is never taken over: the
usual refusal names ``--resume`` and ``--overwrite``.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import psutil

from ...offload.distributed import elastic_attempt
from ..checkpoint.files import latest_checkpoint

LAUNCH_MARKER = ".outcore-launch"  # in the output directory: the launch that wrote it


def launch_id() -> str | None:
    """This torchrun launch, the same across its restarts, or None outside torchrun.

    The elastic agent is the torchrun process, every worker's parent: its host, pid and start
    time name it (a pid alone may be reused), with the rendezvous id where one was given.
    """
    if elastic_attempt() is None:
        return None
    try:
        agent = psutil.Process(os.getppid())
        started = agent.create_time()
    except psutil.Error:  # the agent is gone: no launch to continue
        return None
    return f"{socket.gethostname()} {agent.pid} {started:.3f} {os.environ.get('TORCHELASTIC_RUN_ID', '')}"


def mark_launch(out: Path) -> None:
    """Record the launch that owns ``out`` now (rank 0, once its directory checks passed)."""
    launch = launch_id()
    if launch is not None:
        (out / LAUNCH_MARKER).write_text(launch)


def continue_after_restart(cfg: Any, out: Path) -> str | None:
    """On a torchrun restart of the launch that wrote ``out``: set ``cfg.resume`` (a complete
    checkpoint exists) or ``cfg.overwrite`` (none yet), and say which in one line.

    Returns:
        The line to print, or None when this is no such restart (``cfg`` untouched).
    """
    restart = elastic_attempt() or 0
    if restart == 0 or cfg.resume or cfg.overwrite:
        return None
    launch = launch_id()
    try:
        ours = launch is not None and (out / LAUNCH_MARKER).read_text() == launch
    except OSError:
        return None
    if not ours:
        return None
    newest = latest_checkpoint(out)
    if newest is not None:
        cfg.resume, what = str(out), f"continuing from {newest.name}"
    else:
        cfg.overwrite, what = True, "no complete checkpoint yet: starting over"
    limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
    return f"outcore: torchrun restart {restart} of {limit}: {what} in {out}"
