"""Prompt preparation as diffusers' `Flux2KleinPipeline._get_qwen3_prompt_embeds` does it up to the text
encoder call, without transformers: `tokenizer.json` run by the `tokenizers` library, the chat template
rendered with jinja2 as transformers' `apply_chat_template` does (docs/design/architecture.md).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
from tokenizers import Tokenizer

from klein.errors import CheckpointError, InputError
from klein.io.gguf_tokenizer import read_gguf_tokenizer
from klein.io.json_file import read_json
from klein.models.qwen3 import PROMPT_TOKENS

MAX_LENGTH = PROMPT_TOKENS
# Template variables transformers passes besides the messages (its special-tokens map).
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclasses.dataclass(frozen=True)
class PromptTokenizer:
    """A checkpoint's tokenizer and chat template, ready to turn prompts into padded token ids."""

    tokenizer: Tokenizer
    """The `tokenizer.json` pipeline (normalizer, pre-tokenizer, BPE, post-processor, added tokens)."""
    template: jinja2.Template
    special_tokens: dict[str, str]
    """Special tokens by name (bos_token, pad_token, ...), visible to the template as in transformers."""
    pad_id: int
    # transformers' defaults (Qwen's tokenizer_config.json names no padding or truncation side).
    padding_side: str = "right"
    truncation_side: str = "right"


def load_tokenizer(folder: str | Path) -> PromptTokenizer:
    """Read `<folder>/tokenizer.json`, `tokenizer_config.json` and the chat template (`chat_template.jinja`);
    or, given a GGUF file, the tokenizer and template in its metadata (`klein.io.gguf_tokenizer`)."""
    folder = Path(folder)
    if folder.is_file() and folder.suffix.lower() == ".gguf":
        stored = read_gguf_tokenizer(folder)
        template = _compile(stored.chat_template, folder)
        return PromptTokenizer(stored.tokenizer, template, stored.special_tokens, stored.pad_id)
    config = read_json(folder / "tokenizer_config.json", "the tokenizer configuration")
    try:
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as exc:  # the tokenizers library raises plain Exceptions for missing or bad files
        raise CheckpointError(f"{folder / 'tokenizer.json'}: not a readable tokenizer ({exc})") from None
    special = {name: _token_text(config[name]) for name in _SPECIAL_TOKEN_NAMES if config.get(name)}
    pad_id = tokenizer.token_to_id(special.get("pad_token", ""))
    if pad_id is None:
        raise CheckpointError(f"{folder}: tokenizer_config.json names no pad_token that the vocabulary holds")
    return PromptTokenizer(
        tokenizer=tokenizer,
        template=_compile(_chat_template(folder, config), folder),
        special_tokens=special,
        pad_id=pad_id,
        padding_side=config.get("padding_side", "right"),
        truncation_side=config.get("truncation_side", "right"),
    )


def render_prompt(tokenizer: PromptTokenizer, prompt: str) -> str:
    """The chat-formatted text of one prompt, as `apply_chat_template(..., tokenize=False)` renders it."""
    messages = [{"role": "user", "content": prompt}]
    try:
        return tokenizer.template.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=True,
            enable_thinking=False,
            **tokenizer.special_tokens,
        )
    except jinja2.TemplateError as exc:
        raise CheckpointError(f"the tokenizer's chat template failed to render ({exc})") from None


def tokenize_prompts(
    tokenizer: PromptTokenizer, prompts: str | Sequence[str], max_length: int = MAX_LENGTH
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids int32[B, max_length] and attention mask int32[B, max_length] (1 = real token)."""
    prompts = [prompts] if isinstance(prompts, str) else prompts
    if not (isinstance(prompts, Sequence) and prompts and all(isinstance(p, str) for p in prompts)):
        raise InputError(f"a prompt must be a string or a non-empty list of strings, got {prompts!r:.200}")
    backend = tokenizer.tokenizer
    # Same settings transformers puts on the backend for padding="max_length", truncation=True.
    backend.enable_truncation(max_length, direction=tokenizer.truncation_side)
    backend.enable_padding(
        direction=tokenizer.padding_side,
        pad_id=tokenizer.pad_id,
        pad_token=backend.id_to_token(tokenizer.pad_id),
        length=max_length,
    )
    encodings = backend.encode_batch([render_prompt(tokenizer, p) for p in prompts])
    ids = np.array([e.ids for e in encodings], dtype=np.int32)
    mask = np.array([e.attention_mask for e in encodings], dtype=np.int32)
    return ids, mask


def token_count(tokenizer: PromptTokenizer, prompt: str) -> int:
    """Tokens of `prompt` with its chat template, before truncation: past `MAX_LENGTH` the text encoder
    reads none of them."""
    backend = tokenizer.tokenizer
    backend.no_truncation()
    backend.no_padding()
    return len(backend.encode(render_prompt(tokenizer, prompt)).ids)


def notes(tokenizer: PromptTokenizer, prompts: Sequence[str]) -> tuple[str, ...]:
    """A note for each prompt longer than the text encoder reads: it truncates them to `MAX_LENGTH`
    tokens, as diffusers does."""
    notes = []
    for prompt in dict.fromkeys(prompts):
        count = token_count(tokenizer, prompt)
        if count > MAX_LENGTH:
            notes.append(
                f"prompt {prompt[:30]!r}... is {count} tokens with its chat template; the text encoder "
                f"reads {MAX_LENGTH}, so {count - MAX_LENGTH} were cut ({tokenizer.truncation_side} end)"
            )
    return tuple(notes)


def _token_text(token) -> str:
    # Older tokenizer_config.json files store special tokens as AddedToken dicts.
    return token["content"] if isinstance(token, dict) else str(token)


def _chat_template(folder: Path, config: dict) -> str:
    """`chat_template.jinja` (transformers 5), else the template stored in tokenizer_config.json."""
    path = folder / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    if not isinstance(template, str):
        raise CheckpointError(
            f"{folder}: no chat template (neither chat_template.jinja nor in tokenizer_config)"
        )
    return template


def _compile(source: str, folder: Path) -> jinja2.Template:
    # The environment transformers renders chat templates in: sandboxed, trimmed blocks, loop
    # controls, and a tojson that keeps non-ASCII text as is.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise CheckpointError(f"{folder}: the chat template does not compile ({exc})") from None


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def kept(cache, keys) -> bool:
    """Whether the prompt cache `cache` (None: none) holds every one of `keys` (`cache_keys.prompt_key`):
    then the text encoder does not run for them."""
    return cache is not None and all(key in cache for key in keys)
