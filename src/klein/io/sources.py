"""Where checkpoints live: a local folder, the Hugging Face cache (downloaded there where the hub is
reachable), or the built-in demo."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from klein.errors import CheckpointError, did_you_mean
from klein.models import variants

DEMO = "demo"


def resolve(source: str | os.PathLike) -> tuple[Path, str]:
    """(diffusers-layout folder, name to show) for a folder, a Hugging Face repo id or "demo"."""
    source = str(source)
    if source == DEMO:
        from klein.io import demo  # its configs import the models (and JAX): only when the demo is asked for

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
        reason = "klein is offline (HF_HUB_OFFLINE is set), so it was not downloaded"
    else:
        try:
            return Path(snapshot_download(repo_id))
        except Exception as exc:  # noqa: BLE001 - network, auth (gated repos) and missing repos alike
            reason = _why_not(exc, repo_id)
    published = [v.repo_id for v in variants.VARIANTS.values()]
    close = difflib.get_close_matches(repo_id, [] if repo_id in published else published, n=1, cutoff=0.6)
    raise CheckpointError(  # a published name close to the one given (never the one given) is the one to get
        f"{repo_id}: not in the local Hugging Face cache ({constants.HF_HUB_CACHE}), nor a local folder, and "
        f"{reason}{did_you_mean(repo_id, close) or '.'} Download it where the hub is reachable (`hf download "
        f"{(close or [repo_id])[0]}`, after `hf auth login` for a gated repo such as the 9B ones), or give a "
        "local folder in its place."
    )


def _why_not(error: Exception, repo_id: str) -> str:
    """Why `repo_id` could not be downloaded, in words: no network, a gated or missing repo, or the
    download's own error."""
    from huggingface_hub import errors

    if isinstance(error, errors.GatedRepoError):
        return (
            f"the hub refused it: a gated repo, whose license is accepted at https://huggingface.co/{repo_id} "
            "and whose downloads need a token (`hf auth login`)"
        )
    if isinstance(error, errors.RepositoryNotFoundError):
        return "the hub has no such repo (a private one needs a token: `hf auth login`)"
    if isinstance(error, errors.HFValidationError):
        return "it is not a valid repo id (owner/name)"
    if isinstance(error, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)) or _unreachable(
        error
    ):
        return "the Hugging Face hub could not be reached to download it (no network, or offline)"
    first = str(error).splitlines()[0] if str(error) else ""
    return f"its download failed ({type(error).__name__}: {first})"


def _unreachable(error: BaseException | None) -> bool:
    """Whether `error` or one of its causes is a failed connection (refused, no route, no name, timed out)."""
    while error is not None:
        if isinstance(error, (ConnectionError, TimeoutError)) or "Connect" in type(error).__name__:
            return True
        error = error.__cause__ or error.__context__
    return False
