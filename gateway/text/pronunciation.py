"""Pronunciation dictionaries: per-key rules (a word or a regex -> phonemes or an alias) applied to each segment's
text before normalisation, stored like voices (gateway.store, kind "pronunciation", owner = the key's tenant).

Phonemes are what VoxCPM reads natively with normalisation off or on: braces, `{HH AH0 L OW1}` (CMUdict) or
`{ni3}{hao3}` (pinyin); a rule's phonemes without braces get one pair around them. Rules run in order, each over the
text the rules before it left, except that consecutive word rules (of one case sensitivity) are one scan of the
text: hundreds of words cost about what one does, and where several start at one place the longest wins. Text
inside braces (the client's own phonemes, or an earlier rule's) is never rewritten. A regex gets a time budget per
segment (the `regex` library's timeout): one that runs away is skipped for that segment, and logged."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import regex

from gateway.auth import Caller
from gateway.store import Item, Store, StoreUnavailable
from gateway.voices import Catalog, NotAllowed, NotVisible, Unavailable

log = logging.getLogger("voxgate.pronunciation")

PRONUNCIATION = "pronunciation"
MAX_RULES = 500
MAX_PATTERN_CHARS = 200
MAX_REPLACEMENT_CHARS = 300
MAX_NAME_CHARS = 128
MAX_PER_SESSION = 8  # dictionaries one session may select
REGEX_TIMEOUT_S = 0.02  # per rule and segment
_BRACES = r"(?P<_braced>\{[^{}]*\})"
_PHONEMES = regex.compile(r"(?:\{[^{}\n]+\})+")

Rewrite = Callable[[str], str]


class RuleError(ValueError):
    """A dictionary that cannot be stored: the message names the rule and what is wrong."""


@dataclass(frozen=True)
class Rule:
    """One pass over a segment: a regex rule, or a run of word rules matched together (`words`: the matched word,
    case-folded when `fold`, -> its replacement)."""

    pattern: regex.Pattern
    replacement: str = ""
    words: dict[str, str] | None = None
    fold: bool = False


def check_rules(body: Any) -> tuple[str | None, list[dict[str, Any]]]:
    """`{"name"?, "rules": [{"word" | "regex": ..., "phonemes" | "alias": ..., "case_sensitive"?: bool}]}` ->
    (name, the rules as stored); RuleError naming the first bad rule."""
    if not isinstance(body, dict) or not isinstance(body.get("rules"), list):
        raise RuleError('send a JSON object: {"name": "...", "rules": [{"word": "voxgate", "alias": "vox gate"}]}')
    unknown = sorted(set(body) - {"name", "rules"})
    if unknown:
        raise RuleError(f"unknown field(s): {', '.join(unknown)}")
    name = body.get("name")
    if name is not None and (not isinstance(name, str) or len(name) > MAX_NAME_CHARS):
        raise RuleError(f"name must be a string of at most {MAX_NAME_CHARS} characters")
    rules = body["rules"]
    if not 0 < len(rules) <= MAX_RULES:
        raise RuleError(f"rules must hold 1 to {MAX_RULES} rules")
    out = []
    for i, rule in enumerate(rules):
        where = f"rules[{i}]"
        if not isinstance(rule, dict):
            raise RuleError(f"{where} must be an object")
        extra = sorted(set(rule) - {"word", "regex", "phonemes", "alias", "case_sensitive"})
        if extra:
            raise RuleError(f"{where}: unknown field(s) {', '.join(extra)}")
        if ("word" in rule) == ("regex" in rule) or ("phonemes" in rule) == ("alias" in rule):
            raise RuleError(f"{where} needs one of word/regex and one of phonemes/alias")
        match = rule.get("word", rule.get("regex"))
        value = rule.get("phonemes", rule.get("alias"))
        for field, v, cap in (("word/regex", match, MAX_PATTERN_CHARS), ("phonemes/alias", value,
                                                                         MAX_REPLACEMENT_CHARS)):
            if not isinstance(v, str) or not v.strip() or len(v) > cap:
                raise RuleError(f"{where}.{field} must be a non-empty string of at most {cap} characters")
        case = rule.get("case_sensitive", True)
        if not isinstance(case, bool):
            raise RuleError(f"{where}.case_sensitive must be a boolean")
        if "phonemes" in rule:
            value = value.strip()
            if "{" not in value and "}" not in value:
                value = "{" + value + "}"
            if not _PHONEMES.fullmatch(value):
                raise RuleError(f"{where}.phonemes must be phonemes ('HH AH0 L OW1') or braced groups "
                                "('{ni3}{hao3}')")
        elif "{" in value or "}" in value:
            raise RuleError(f"{where}.alias is text to speak: give phonemes in 'phonemes'")
        stored = {"word" if "word" in rule else "regex": match,
                  "phonemes" if "phonemes" in rule else "alias": value, "case_sensitive": case}
        _compile(stored, where)
        out.append(stored)
    return name, out


def _compile(rule: dict[str, Any], where: str = "rule") -> Rule:
    source = rf"(?<!\w){regex.escape(rule['word'])}(?!\w)" if "word" in rule else rule["regex"]
    flags = regex.V0 | (0 if rule.get("case_sensitive", True) else regex.IGNORECASE)
    try:
        # the rule's own pattern first, so its group numbers (and back-references) are its own
        pattern = regex.compile(f"(?:{source})|{_BRACES}", flags)
    except regex.error as e:
        raise RuleError(f"{where}.regex does not compile: {e}") from None
    if pattern.match(""):
        raise RuleError(f"{where}.regex matches empty text")
    return Rule(pattern, rule.get("phonemes") or rule["alias"])


def _word_pass(run: list[dict[str, Any]]) -> Rule:
    """Consecutive word rules of one case sensitivity as one pattern: one scan of the segment, however many words
    (the longest word wins where several start; the first rule of a word wins over a later one)."""
    fold = not run[0].get("case_sensitive", True)
    words: dict[str, str] = {}
    for rule in run:
        words.setdefault(rule["word"].casefold() if fold else rule["word"], rule.get("phonemes") or rule["alias"])
    alternatives = "|".join(regex.escape(w) for w in sorted(words, key=len, reverse=True))
    flags = regex.V0 | (regex.IGNORECASE if fold else 0)
    return Rule(regex.compile(rf"(?<!\w)(?:{alternatives})(?!\w)|{_BRACES}", flags), words=words, fold=fold)


def compile_rules(rules: list[dict[str, Any]]) -> list[Rule]:
    """Stored rules -> the passes that apply them, in order (checked when stored)."""
    passes: list[Rule] = []
    run: list[dict[str, Any]] = []
    for rule in [*rules, None]:
        if rule is not None and "word" in rule and (not run or run[0].get("case_sensitive", True)
                                                      == rule.get("case_sensitive", True)):
            run.append(rule)
            continue
        if run:
            passes.append(_word_pass(run))
            run = []
        if rule is None:
            break
        if "word" in rule:
            run.append(rule)
        else:
            passes.append(_compile(rule))
    return passes


def apply(rules: list[Rule], text: str) -> str:
    """`text` with every rule applied in order, braces left as they are."""
    for rule in rules:
        def swap(m: regex.Match, rule: Rule = rule) -> str:
            if m.group("_braced") is not None:
                return m.group(0)
            if rule.words is None:
                return rule.replacement
            word = m.group(0)
            return rule.words.get(word.casefold() if rule.fold else word, word)

        try:
            text = rule.pattern.sub(swap, text, timeout=REGEX_TIMEOUT_S)
        except TimeoutError:
            log.warning("pronunciation rule %r took over %.0f ms on a segment: skipped for it",
                        rule.pattern.pattern[:80], REGEX_TIMEOUT_S * 1000)
    return text


class Pronunciations:
    """The dictionaries as each caller sees them (who may see and change what: `Catalog`'s rules)."""

    def __init__(self, store: Store):
        self.store = store
        self._compiled: dict[str, tuple[float, list[Rule]]] = {}  # id -> (created, rules): ids are never reused

    async def _get(self, dict_id: str) -> Item | None:
        try:
            return await self.store.get(PRONUNCIATION, dict_id)
        except StoreUnavailable as e:
            raise Unavailable(str(e)) from None

    @staticmethod
    def view(item: Item) -> dict[str, Any]:
        return {"pronunciation_id": item.id, "name": item.meta.get("name"), "rules": item.meta["rules"],
                "public": item.public}

    async def create(self, caller: Caller, body: Any) -> dict[str, Any]:
        """Check and store a dictionary for the caller's key (RuleError when it is not valid)."""
        name, rules = check_rules(body)
        item = Item(PRONUNCIATION, uuid.uuid4().hex[:12], caller.tenant, created=time.time(),
                    meta={"name": name, "rules": rules})
        try:
            await self.store.put(item, {})
        except StoreUnavailable as e:
            raise Unavailable(str(e)) from None
        return self.view(item)

    async def list(self, caller: Caller) -> list[dict[str, Any]]:
        try:
            items = await self.store.items(PRONUNCIATION)
        except StoreUnavailable as e:
            raise Unavailable(str(e)) from None
        return [self.view(i) for i in items if Catalog.visible(i, caller)]

    async def delete(self, caller: Caller, dict_id: str) -> None:
        item = await self._get(dict_id)
        if item is None or not Catalog.visible(item, caller):
            raise NotVisible(f"no pronunciation dictionary {dict_id!r}", code="unknown_pronunciation")
        if not Catalog.manageable(item, caller):
            raise NotAllowed("this dictionary is shared by an operator: only its owner or an operator key may "
                             "delete it")
        try:
            await self.store.delete(PRONUNCIATION, dict_id)
        except StoreUnavailable as e:
            raise Unavailable(str(e)) from None
        self._compiled.pop(dict_id, None)

    async def rewrite(self, dict_ids: list[str], caller: Caller) -> Rewrite | None:
        """The rewrite the dictionaries make, in the order given (None for none); NotVisible names an id the
        caller may not use (another key's is answered as one that does not exist)."""
        rules: list[Rule] = []
        for dict_id in dict_ids:
            item = await self._get(dict_id)
            if item is None or not Catalog.visible(item, caller):
                raise NotVisible(f"no pronunciation dictionary {dict_id!r}", code="unknown_pronunciation")
            cached = self._compiled.get(dict_id)
            if cached is None or cached[0] != item.created:
                cached = self._compiled[dict_id] = (item.created, compile_rules(item.meta["rules"]))
            rules.extend(cached[1])
        if not rules:
            return None
        return lambda text: apply(rules, text)
