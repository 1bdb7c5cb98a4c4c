"""Text normalisation and tokenisation, identical to the official VoxCPM pipeline.

The official code runs `LlamaTokenizerFast` over the release `tokenizer.json` (no BOS/EOS) and then splits every
multi-character CJK vocabulary entry into single characters (`mask_multichar_chinese_tokens`). The `tokenizers`
library alone reproduces this, so `transformers` is not needed at run time.
"""

from __future__ import annotations

import re
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

SPACE_MARK = "\u2581"  # SentencePiece's word-start marker "▁"
UNK_TOKEN = "<unk>"


class TokenizerError(ValueError):
    """The tokenizer files are missing or unreadable."""


def normalize_text(text: str) -> str:
    """Newlines become spaces and whitespace runs collapse to one space (as the official `generate`)."""
    return re.sub(r"\s+", " ", text.replace("\n", " "))


def _is_cjk_word(token: str) -> bool:
    return len(token) >= 2 and all("\u4e00" <= c <= "\u9fff" for c in token)


class Tokenizer:
    """The VoxCPM text tokenizer: `encode(text)` gives the ids the official model sees."""

    def __init__(self, backend: _HFTokenizer):
        self.backend = backend
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._cjk_words = {token for token in vocab if _is_cjk_word(token)}
        unk = vocab.get(UNK_TOKEN)
        self._unk_id = 0 if unk is None else unk

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        try:
            return cls(_HFTokenizer.from_file(str(path)))
        except Exception as e:  # the tokenizers library raises a bare Exception for unreadable JSON
            raise TokenizerError(f"{path}: cannot load tokenizer ({e})") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Loads `tokenizer.json` from a model directory."""
        file = Path(path) / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(f"{file}: file not found")
        return cls.from_file(file)

    def tokenize(self, text: str) -> list[str]:
        """Token strings after the CJK split rule (the official wrapper removes every "▁" before the check)."""
        out: list[str] = []
        for token in self.backend.encode(text, add_special_tokens=False).tokens:
            bare = token.replace(SPACE_MARK, "")
            if bare in self._cjk_words:
                out.extend(bare)
            else:
                out.append(token)
        return out

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no BOS/EOS); call `normalize_text` first for user input."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str (got {type(text).__name__})")
        ids = []
        for token in self.tokenize(text):
            token_id = self.backend.token_to_id(token)
            ids.append(self._unk_id if token_id is None else token_id)
        return ids
