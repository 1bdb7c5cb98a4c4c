"""Text normalisation and tokenisation, identical to the official VoxCPM pipeline.

The official code runs `LlamaTokenizerFast` over the release `tokenizer.json` (no BOS/EOS) and then splits every
multi-character CJK vocabulary entry into single characters (`mask_multichar_chinese_tokens`). The `tokenizers`
library alone reproduces this, so `transformers` is not needed at run time.

The file is run as written, as transformers 4.x's LlamaTokenizerFast runs it (the tokens the model was trained on):
the release's normalizer prepends "▁" and turns each space into "▁", so text that begins with whitespace starts with
two. transformers 5.x's LlamaTokenizer replaces the file's normalizer with its own Metaspace pre-tokenizer and gives
one "▁" fewer there (tests/test_text.py pins both).
"""

from __future__ import annotations

import re
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

SPACE_MARK = "\u2581"  # SentencePiece's word-start marker "▁"
UNK_TOKEN = "<unk>"


class TokenizerError(ValueError):
    """The tokenizer files are missing or unreadable."""


# Every whitespace run becomes one space: runs of two or more, or one whitespace character other than a space (a
# lone space is already right, and not rewriting each one makes this ~25% faster on English text)
_WHITESPACE = re.compile(r"\s{2,}|[^\S ]")


def normalize_text(text: str) -> str:
    """Newlines become spaces and whitespace runs collapse to one space (as the official `generate`, which
    replaces "\\n" first: "\\n" is whitespace, so one substitution gives the same string)."""
    return _WHITESPACE.sub(" ", text)


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
        # `encode` takes the ids the backend returns and rewrites only the ids whose token the reference path
        # (`tokenize`, then one vocabulary lookup per token string) maps elsewhere: the CJK words it splits, and
        # any id whose string looks up another id (a duplicate string: no entry of the vocabulary dict has it).
        self._rewrite: dict[int, list[int]] = {}
        for token, token_id in vocab.items():
            if token.replace(SPACE_MARK, "") in self._cjk_words:
                self._rewrite[token_id] = self._lookup(self._split(token))
        known = set(vocab.values())
        for token_id in range(max(known, default=-1) + 1):
            token = None if token_id in known else backend.id_to_token(token_id)
            if token is not None:
                self._rewrite[token_id] = self._lookup(self._split(token))

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

    def _split(self, token: str) -> list[str]:
        """The CJK split rule on one token: a multi-character CJK word ("▁" removed) becomes its characters."""
        bare = token.replace(SPACE_MARK, "")
        return list(bare) if bare in self._cjk_words else [token]

    def _lookup(self, tokens: list[str]) -> list[int]:
        """Vocabulary ids of token strings, `<unk>` for strings the vocabulary lacks (as `convert_tokens_to_ids`)."""
        ids = []
        for token in tokens:
            token_id = self.backend.token_to_id(token)
            ids.append(self._unk_id if token_id is None else token_id)
        return ids

    def tokenize(self, text: str) -> list[str]:
        """Token strings after the CJK split rule (the official wrapper removes every "▁" before the check)."""
        out: list[str] = []
        for token in self.backend.encode(text, add_special_tokens=False).tokens:
            out.extend(self._split(token))
        return out

    def encode_reference(self, text: str) -> list[int]:
        """`encode` done as the official wrapper does it (token strings, then one lookup each): the slow path
        `encode` must match, kept for the tests."""
        return self._lookup(self.tokenize(text))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no BOS/EOS); call `normalize_text` first for user input."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str (got {type(text).__name__})")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        rewrite = self._rewrite
        if rewrite.keys().isdisjoint(ids):  # English, most text: the backend's ids as they are
            return ids
        out: list[int] = []
        for token_id in ids:
            new = rewrite.get(token_id)
            if new is None:
                out.append(token_id)
            else:
                out.extend(new)
        return out
