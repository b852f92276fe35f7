"""Where checkpoints live: a local folder, the Hugging Face cache (downloaded there where the hub is
reachable), or the built-in demo."""

from __future__ import annotations

import os
from pathlib import Path

from klein.errors import CheckpointError
from klein.io import demo
from klein.models import variants

DEMO = "demo"


def resolve(source: str | os.PathLike) -> tuple[Path, str]:
    """(diffusers-layout folder, name to show) for a folder, a Hugging Face repo id or "demo"."""
    source = str(source)
    if source == DEMO:
        return demo.ensure_demo(), variants.DEMO_LABEL
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path}: expected a diffusers-layout checkpoint folder, got a file")
        return path, str(path)
    if source.count("/") == 1 and not source.startswith((".", "/", "~")):
        return _from_hub(source), source
    raise CheckpointError(
        f"unknown model {source!r}: no such folder, and not a Hugging Face repo id (owner/name). "
        f"Known repos: {', '.join(v.repo_id for v in variants.VARIANTS.values())}; or use 'demo'."
    )


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - any cache miss falls through to a download attempt
        pass
    if constants.HF_HUB_OFFLINE:
        reason = "HF_HUB_OFFLINE is set"
    else:
        try:
            return Path(snapshot_download(repo_id))
        except Exception as exc:  # noqa: BLE001 - network, auth (gated repos) and missing repos alike
            reason = f"download failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    raise CheckpointError(
        f"{repo_id}: not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and {reason}. "
        f"Download it where the hub is reachable (`hf download {repo_id}`, after `hf auth login` for gated "
        f"9B repos) or pass --model with a local folder."
    )
