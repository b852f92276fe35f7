"""GET /v1/models in OpenAI's shape, which OpenAI's clients and tools probe: the one model this server runs,
by the name `model` is compared with (a request naming it is not warned of as ignored)."""

from __future__ import annotations


def model_list(name: str, created: int) -> dict:
    """OpenAI's list of models: `name` the server's model (a repo id, a folder or the demo's label),
    `created` unix seconds (the server's start: a checkpoint has no creation time of its own)."""
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": created, "owned_by": owner(name)}],
    }


def owner(name: str) -> str:
    """A Hugging Face repo id's owner ("black-forest-labs"), else "local" (a folder, the demo)."""
    first, slash, rest = name.partition("/")
    repo_id = slash and first and rest and "/" not in rest and not first.startswith((".", "~"))
    return first if repo_id and " " not in name else "local"
