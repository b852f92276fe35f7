"""GET /v1/models in OpenAI's shape, which OpenAI's clients and tools probe: the one model this server runs,
by an id a request's `model` may name (a request naming it, or the model's full name, is not warned of as
ignored)."""

from __future__ import annotations

from pathlib import Path

from klein.io.sources import DEMO
from klein.models.variants import DEMO_LABEL


def model_list(name: str, created: int) -> dict:
    """OpenAI's list of models: `name` the server's model as /healthz names it (a repo id, a folder or file,
    the demo's label), listed by its `model_id` with `name` as its description; `created` unix seconds (the
    server's start: a checkpoint has no creation time of its own)."""
    listed = {"id": model_id(name), "object": "model", "created": created, "owned_by": owner(name)}
    return {"object": "list", "data": [{**listed, "description": name}]}


def model_id(name: str) -> str:
    """The id of a model named `name`: "demo" for the demo checkpoint (as --model takes it), a repo id
    as it is, a folder's name or a file's stem for a local checkpoint."""
    if name == DEMO_LABEL:
        return DEMO
    if owner(name) != "local":
        return name
    path = Path(name)
    return (path.stem if path.is_file() else path.name) or name


def owner(name: str) -> str:
    """A Hugging Face repo id's owner ("black-forest-labs"), else "local" (a folder, the demo)."""
    first, slash, rest = name.partition("/")
    repo_id = slash and first and rest and "/" not in rest and not first.startswith((".", "~"))
    return first if repo_id and " " not in name else "local"
