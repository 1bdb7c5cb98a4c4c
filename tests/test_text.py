"""Our tokenizer (the `tokenizers` library alone) against the official LlamaTokenizerFast + CJK split wrapper.

The release's tokenizer.json (MiniCPM's legacy Llama layout, copied by the tiny checkpoints) prepends "▁" and turns
every space into "▁" in its normalizer. transformers 4.x's LlamaTokenizerFast runs that file as written; 5.x's
rebuilds the pipeline from its own defaults (no normalizer, a Metaspace pre-tokenizer), which drops one "▁" from text
that begins with whitespace. The model was trained on the file's tokens, so the reference here is the file as written
(what 4.x's LlamaTokenizerFast loads), and the 5.x difference is pinned below."""

from pathlib import Path

import pytest
import transformers
from transformers import LlamaTokenizerFast, PreTrainedTokenizerFast
from voxcpm.model.utils import mask_multichar_chinese_tokens

from engine.random_checkpoint import tokenizer_json, write_tokenizer
from engine.text import Tokenizer, TokenizerError, normalize_text

TEXTS = [
    "Hello world.", "你好，世界！今天天气很好。", "Mixed 中文 and English 语音合成, ok?", "我们可以说中文",
    "  odd   spaces\t\tand\ttabs ", "emoji 😀🎉 café naïve ß", "punctuation!?…—«»“”()[]{};:'\"", "3.14 ABC x_y-z",
    "<s>literal</s> <|audio_start|>", "▁already marked", "", " ", "日本語のテキスト", "한국어 텍스트",
    " leading space", "\tleading tab", " 你好", "  two leading spaces",
]
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


def release_tokenizer(model_dir: Path) -> PreTrainedTokenizerFast:
    """The tokenizer the official code loads, as transformers 4.x loads it: tokenizer.json as written."""
    if TRANSFORMERS_5:
        return PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    return LlamaTokenizerFast.from_pretrained(str(model_dir))


@pytest.fixture(scope="module", params=[512, 73448], ids=["tiny-vocab", "release-vocab"])
def tokenizers_pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"tok{request.param}")
    write_tokenizer(d, request.param)
    official = mask_multichar_chinese_tokens(release_tokenizer(d))
    return Tokenizer.from_dir(d), official, request.param, d


def test_matches_official(tokenizers_pair):
    ours, official, vocab_size, _ = tokenizers_pair
    assert ours.vocab_size == vocab_size
    assert official.multichar_tokens, "the test tokenizer must contain multi-character CJK tokens"
    for text in TEXTS:
        assert ours.encode(text) == official(text), text
        assert ours.encode(normalize_text(text)) == official(normalize_text(text)), text


def test_cjk_words_are_split(tokenizers_pair):
    ours, _, _, _ = tokenizers_pair
    tokens = ours.tokenize("我们可以说中文")
    assert all(len(t.replace("\u2581", "")) <= 1 for t in tokens), tokens
    assert 0 not in ours.encode("我们可以说中文")  # every character of the training text has its own id


def test_no_bos_or_eos(tokenizers_pair):
    ours, _, _, _ = tokenizers_pair
    ids = ours.encode("Hello world.")
    assert ids and ids[0] != 1 and ids[-1] != 2


def test_leading_whitespace_keeps_the_files_extra_space_mark(tokenizers_pair):
    """Text that begins with whitespace starts with two "▁" (the file's Prepend, then its space), as transformers 4.x
    gives; transformers 5.x's LlamaTokenizerFast gives one fewer and matches us otherwise."""
    ours, _, _, model_dir = tokenizers_pair
    for text in (" leading space", " 你好", "  two leading spaces"):
        tokens = ours.tokenize(text)
        assert "".join(tokens).startswith("\u2581" * (len(text) - len(text.lstrip()) + 1)), (text, tokens)
        assert ours.tokenize(text.lstrip())[0].startswith("\u2581")
        if TRANSFORMERS_5:
            five = LlamaTokenizerFast.from_pretrained(str(model_dir)).tokenize(text)
            assert "".join(five) == "".join(ours.backend.encode(text, add_special_tokens=False).tokens)[1:]


def test_normalize_text():
    assert normalize_text("a\nb\r\n  c\t\td ") == "a b c d "
    assert normalize_text("\n\n") == " "


def test_writer_is_deterministic():
    assert tokenizer_json(512) == tokenizer_json(512)


def test_bad_files(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json: file not found"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(TokenizerError, match="cannot load tokenizer"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(TypeError):
        Tokenizer.from_file(write_tokenizer(tmp_path, 512) or tmp_path / "tokenizer.json").encode(None)
