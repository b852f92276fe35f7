"""Qwen's tokenizer rebuilt from a GGUF file's own metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`),
which for `pre = "qwen2"` is the pipeline of Qwen's `tokenizer.json` (docs/design/checkpoints.md).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from klein.errors import CheckpointError
from klein.io.gguf_header import read_header

# The split pattern of Qwen2's (and Qwen3's) tokenizer.json, llama.cpp's pre-tokenizer "qwen2".
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
_K = gguf.Keys.Tokenizer
_T = gguf.TokenType
# Template variables transformers passes (its special-tokens map) and the GGUF id that names each.
_SPECIAL_IDS = {
    "bos_token": _K.BOS_ID,
    "eos_token": _K.EOS_ID,
    "unk_token": _K.UNK_ID,
    "pad_token": _K.PAD_ID,
}


@dataclasses.dataclass(frozen=True)
class GGUFTokenizer:
    """What a tokenizer folder gives, read from a GGUF instead."""

    tokenizer: Tokenizer
    chat_template: str
    special_tokens: dict[str, str]
    """Special tokens by name (bos_token, pad_token, ...), as `tokenizer_config.json` names them."""
    pad_id: int


def holds_tokenizer(path: str | Path) -> bool:
    """Whether the GGUF at `path` has a tokenizer in its metadata."""
    return _K.MODEL in read_header(path).metadata


def read_gguf_tokenizer(path: str | Path) -> GGUFTokenizer:
    """The tokenizer and chat template stored in the GGUF at `path` (a Qwen3 one: `pre` = "qwen2")."""
    path = Path(path)
    header = read_header(path)
    model, pre = header.text(_K.MODEL), header.text(_K.PRE)
    if model is None:
        raise CheckpointError(
            f"{path}: no tokenizer in its metadata ({_K.MODEL}); name the tokenizer's folder (--tokenizer)"
        )
    if (model, pre) != ("gpt2", "qwen2"):
        raise CheckpointError(
            f"{path}: its tokenizer is {model!r} with pre-tokenizer {pre!r}; klein rebuilds Qwen's "
            f"('gpt2', 'qwen2') only. Name the tokenizer's folder (--tokenizer) instead"
        )
    tokens, types = header.strings(_K.LIST), header.integers(_K.TOKEN_TYPE)
    merges, template = header.strings(_K.MERGES), header.text(_K.CHAT_TEMPLATE)
    missing = [name for name, value in ((_K.MERGES, merges), (_K.CHAT_TEMPLATE, template)) if not value]
    if not tokens or not types or len(tokens) != len(types) or missing:
        raise CheckpointError(
            f"{path}: the GGUF metadata has no complete tokenizer ({', '.join(missing) or _K.LIST}); name "
            f"the tokenizer's folder (--tokenizer) instead"
        )
    ids = {name: header.integer(key) for name, key in _SPECIAL_IDS.items()}
    special = {name: tokens[i] for name, i in ids.items() if i is not None and 0 <= i < len(tokens)}
    if "pad_token" not in special:
        raise CheckpointError(f"{path}: the GGUF metadata names no padding token ({_K.PAD_ID})")
    return GGUFTokenizer(_tokenizer(path, tokens, types, merges), template, special, int(ids["pad_token"]))


def _tokenizer(path: Path, tokens: list[str], types: list[int], merges: list[str]) -> Tokenizer:
    """Qwen's `tokenizer.json` pipeline over this vocabulary (of the GGUF at `path`, for messages)."""
    # Added tokens stay in the BPE vocabulary too, so that they keep their ids when added; no merge forms them.
    vocab = {token: i for i, (token, kind) in enumerate(zip(tokens, types, strict=True)) if kind != _T.UNUSED}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    # The tokenizers library panics on a merge whose parts or result are not tokens (a Rust panic, which no
    # `except Exception` catches): each is checked here first.
    for pair in pairs:
        if len(pair) != 2 or not all(part in vocab for part in (*pair, "".join(pair))):
            raise CheckpointError(
                f"{path}: the GGUF tokenizer's merge {' '.join(pair)!r} is not two tokens that join into a "
                f"third; name the tokenizer's folder (--tokenizer) instead"
            )
    tokenizer = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    added = [
        AddedToken(token, special=kind == _T.CONTROL, normalized=False)
        for token, kind in zip(tokens, types, strict=True)
        if kind in (_T.CONTROL, _T.USER_DEFINED)
    ]
    tokenizer.add_tokens(added)
    return tokenizer
