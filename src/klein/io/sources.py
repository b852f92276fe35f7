"""Where checkpoints live: a local folder, the Hugging Face cache (downloaded there where the hub is
reachable), or the built-in demo."""

from __future__ import annotations

import os
from pathlib import Path

from klein.errors import CheckpointError, did_you_mean
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
    published = _published(source)
    if published is not None:  # a variant's name (as `klein plan` takes it), or its repo in any case
        return _from_hub(published), published
    if remote(source):
        return _from_hub(source), source
    raise CheckpointError(
        f"unknown model {source!r}{did_you_mean(source, _known())}: no such folder, and not a Hugging Face "
        f"repo id (owner/name). Known: {', '.join(_known())}; or use 'demo'."
    )


def remote(source: str) -> bool:
    """Whether `source`, not a local path, names a Hugging Face repo: a published variant's name or repo id,
    or any owner/name."""
    return _published(source) is not None or (
        source.count("/") == 1 and not source.startswith((".", "/", "~"))
    )


def _known() -> list[str]:
    """The published variants' names and repo ids."""
    return [*variants.VARIANTS, *(v.repo_id for v in variants.VARIANTS.values())]


def _published(source: str) -> str | None:
    """The repo id of the published variant `source` names by its name or its repo id in any case (the
    hub's cache is case-sensitive: "flux.2-klein-4b" would miss "FLUX.2-klein-4B")."""
    for variant in variants.VARIANTS.values():
        if source == variant.name or source.lower() == variant.repo_id.lower():
            return variant.repo_id
    return None


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
    close = did_you_mean(repo_id, [v.repo_id for v in variants.VARIANTS.values()])
    raise CheckpointError(
        f"{repo_id}: not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and {reason}"
        f"{close or '.'} Download it where the hub is reachable (`hf download {repo_id}`, after `hf auth "
        "login` for gated 9B repos), or give a local folder in its place."
    )
