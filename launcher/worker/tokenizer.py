"""Tokenizers for the worker: an HF tokenizer from a local path, or a byte-level one.

The byte-level tokenizer needs no files, so a randomly initialised model can train on any
UTF-8 text: ids 0, 1, 2 are pad, bos, eos (the ids LlamaConfig uses by default for bos/eos) and
byte b has id b + 3, so the vocabulary has 3 + 256 = 259 entries.
"""
from __future__ import annotations

from typing import Optional, Protocol, Sequence

from launcher.errors import ConfigError

BYTE_OFFSET = 3
BYTE_VOCAB_SIZE = BYTE_OFFSET + 256


class TextTokenizer(Protocol):
    vocab_size: int
    eos_token_id: Optional[int]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...


class ByteTokenizer:
    """UTF-8 bytes shifted past the special ids: pad=0, bos=1, eos=2, bytes 3..258."""

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    vocab_size = BYTE_VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(i - BYTE_OFFSET for i in ids if i >= BYTE_OFFSET)
        return data.decode("utf-8", errors="replace")

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]


class HFTokenizer:
    """Adapter over `transformers.AutoTokenizer`; `vocab_size` counts added tokens (`len(tok)`)."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self.vocab_size = len(tokenizer)
        self.eos_token_id = tokenizer.eos_token_id

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._tok(list(texts), add_special_tokens=False)["input_ids"]


def load_tokenizer(tokenizer_path: Optional[str], init: str, trust_remote_code: bool) -> TextTokenizer:
    """HF tokenizer from `tokenizer_path` (local files only); byte-level when none is given and
    the model is randomly initialised (a pretrained model needs its own tokenizer)."""
    if tokenizer_path is None:
        if init != "random":
            raise ConfigError("init='pretrained' needs tokenizer_path (the model's own tokenizer)")
        return ByteTokenizer()
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(
            tokenizer_path, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"cannot load tokenizer from {tokenizer_path}: {first_line}") from None
    return HFTokenizer(tok)


def check_vocab(tokenizer: TextTokenizer, model_vocab_size: int) -> None:
    """Every id the tokenizer can emit must index the model's embedding table."""
    if tokenizer.vocab_size > model_vocab_size:
        raise ConfigError(
            f"tokenizer vocabulary ({tokenizer.vocab_size} ids) is larger than the model's "
            f"vocab_size={model_vocab_size}; use the model's own tokenizer or raise vocab_size "
            f"to at least {tokenizer.vocab_size}"
        )
