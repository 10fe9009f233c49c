"""``push_to_hub=REPO``: upload a run's exported model (``OUTPUT/final``) to the Hugging Face Hub.

Runs after the export, so a failed upload (offline, no token, no permission) never costs
the run: its outputs stay on disk and the error says how to upload them later.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import OutcoreError


class HubError(OutcoreError):
    """The upload to the Hugging Face Hub failed (the run's outputs are kept)."""


def push_to_hub(final_dir: str | Path, repo_id: str, *, private: bool | None = None) -> str:
    """Create ``repo_id`` if needed and upload ``final_dir`` into it, through ``huggingface_hub``.

    Args:
        final_dir: the exported Hugging Face directory (``OUTPUT/final``).
        repo_id: ``user/name`` (or ``org/name``) on the Hub; the token is huggingface_hub's own
            (``HF_TOKEN`` or ``hf auth login``).
        private: create the repository private (None: the Hub's default).

    Returns:
        The URL of the commit.

    Raises:
        HubError: offline (``HF_HUB_OFFLINE=1`` or no network), no or wrong token, or any
            other refusal: one line naming the repository, the cause and the command to retry.
    """
    from huggingface_hub import HfApi

    final = Path(final_dir)
    retry = f"the run's outputs are kept; upload them later with `hf upload {repo_id} {final}`"
    if not final.is_dir():
        raise HubError(f"push_to_hub={repo_id!r}: {str(final)!r} does not exist (export=false?); {retry}")
    try:
        api = HfApi()
        api.create_repo(repo_id, private=private, exist_ok=True)
        commit = api.upload_folder(folder_path=str(final), repo_id=repo_id,
                                   commit_message="Upload model fine-tuned with outcore")
    except Exception as e:  # noqa: BLE001 - offline, DNS, HTTP 401/403/404, ...: any of them leaves the outputs be
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HubError(f"push_to_hub={repo_id!r} failed ({type(e).__name__}: {cause}); {retry}") from None
    return str(getattr(commit, "commit_url", commit))
