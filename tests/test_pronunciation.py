"""Pronunciation dictionaries (issue 35): the rules themselves, their place in the text path (before normalisation,
phoneme braces untouched), and the HTTP API + session selection + ElevenLabs' locators on a real server with real
clients and the real tiny engine, checked by what reached the engine."""

import json

import aiohttp
import pytest
import pytest_asyncio
import websockets
from compat_support import compat_server
from engine_calls import recorded_calls

from gateway.auth import Auth
from gateway.client import ServerError, VoxgateClient
from gateway.server import ServerConfig, create_app, start_server
from gateway.text.pronunciation import RuleError, apply, check_rules, compile_rules
from gateway.text.segmenter import Segmenter

pytestmark = [pytest.mark.timeout(120)]
on_server = pytest.mark.asyncio(loop_scope="module")

A, B = "key-a", "key-b"
RULES = {"name": "brand", "rules": [
    {"word": "voxgate", "alias": "vox gate", "case_sensitive": False},
    {"word": "tomato", "phonemes": "T AH0 M EY1 T OW2"},
    {"regex": r"\bv(\d)\1?\b", "alias": "version 2"},  # the rule's own group numbers (back-references) hold
    {"word": "你好", "phonemes": "{ni3}{hao3}"},
]}


def _rewrite(body: dict) -> object:
    rules = compile_rules(check_rules(body)[1])
    return lambda text: apply(rules, text)


def test_rules_rewrite_words_and_regexes_and_leave_braces_alone():
    rewrite = _rewrite(RULES)
    assert rewrite("VoxGate grows tomatoes, a tomato.") == "vox gate grows tomatoes, a {T AH0 M EY1 T OW2}."
    assert rewrite("{tomato} stays, voxgate's tomato") == "{tomato} stays, vox gate's {T AH0 M EY1 T OW2}"
    assert rewrite("你好世界") == "你好世界"  # whole words only: CJK runs are one \w word
    assert rewrite("说 你好 吧") == "说 {ni3}{hao3} 吧"
    assert rewrite("v2 and v22 and v23") == "version 2 and version 2 and v23"


@pytest.mark.parametrize("body, problem", [
    ({"rules": []}, "1 to"),
    ({"rules": [{"word": "a"}]}, "one of"),
    ({"rules": [{"word": "a", "regex": "b", "alias": "c"}]}, "one of"),
    ({"rules": [{"regex": "(", "alias": "x"}]}, "compile"),
    ({"rules": [{"regex": "a*", "alias": "x"}]}, "empty"),
    ({"rules": [{"word": "a", "alias": "{AH0}"}]}, "phonemes"),
    ({"rules": [{"word": "a", "phonemes": "{AH0"}]}, "braced"),
    ({"rules": [{"word": "a", "alias": "b", "speed": 1}]}, "unknown"),
    ({"rules": [{"word": "", "alias": "b"}]}, "non-empty"),
    ({"rules": [{"word": "a", "alias": "b", "case_sensitive": "no"}]}, "boolean"),
    ([], "JSON object"),
])
def test_bad_rules_are_named(body, problem):
    with pytest.raises(RuleError, match=problem):
        check_rules(body)


def test_consecutive_word_rules_are_one_scan_longest_first():
    rewrite = _rewrite({"rules": [{"word": "New York", "alias": "N Y"}, {"word": "New York City", "alias": "N Y C"},
                                  {"word": "N Y", "alias": "never"}, {"word": "new york", "alias": "first",
                                                                      "case_sensitive": False}]})
    # one scan: the alias "N Y" is not matched again by the later "N Y" rule of the same run
    assert rewrite("New York City and New York") == "N Y C and N Y"
    assert rewrite("NEW YORK") == "first"  # a run of another case sensitivity is the next pass


def test_a_runaway_regex_is_skipped_not_hung():
    rewrite = _rewrite({"rules": [{"regex": "(x+x+)+y", "alias": "z"}, {"word": "end", "alias": "fin"}]})
    assert rewrite("x" * 40 + " end") == "x" * 40 + " fin"


def test_rules_apply_before_normalisation_and_phonemes_pass_it():
    seg = Segmenter(normalize="on", rewrite=_rewrite(RULES))
    out = seg.push("Try v2 of voxgate, {HH AH0 L OW1} tomato. ") + seg.end()
    spoken = " ".join(s.speak() for s in out)
    assert "version two of vox gate" in spoken and "{HH AH0 L OW1}" in spoken and "{T AH0 M EY1 T OW2}" in spoken
    assert " ".join(s.text for s in out) == "Try v2 of voxgate, {HH AH0 L OW1} tomato."
    shown = " ".join(s.shown() for s in out)  # for clients: normalised, without the rules' respellings
    assert "v two of voxgate" in shown and "{HH AH0 L OW1}" in shown and "T AH0" not in shown


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(engine):
    runner, port = await start_server(create_app(engine, ServerConfig(web_client_dir=None),
                                                 auth=Auth({A: [], B: []}), compat=True))
    async with aiohttp.ClientSession() as http:
        yield port, http
    await runner.cleanup()


async def _post(http, port, key, body) -> tuple[int, dict]:
    async with http.post(f"http://127.0.0.1:{port}/v1/pronunciations", json=body,
                         headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, await r.json()


@on_server
async def test_a_sessions_dictionaries_rewrite_what_the_engine_speaks(server, engine):
    port, http = server
    status, made = await _post(http, port, A, RULES)
    assert status == 201 and made["name"] == "brand" and made["rules"][1]["phonemes"] == "{T AH0 M EY1 T OW2}"
    async with http.get(f"http://127.0.0.1:{port}/v1/pronunciations", headers={"Authorization": f"Bearer {A}"}) as r:
        assert made in (await r.json())["pronunciations"]
    with recorded_calls(engine) as calls:
        async with await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream", api_key=A) as c:
            await c.start(output={"format": "pcm_s16le"}, generation={
                "seed": 1, "max_length": 2, "normalize": "off", "pronunciations": [made["pronunciation_id"]]})
            utt = await c.speak("Voxgate says tomato.", "t")
    assert [text for text, _ in calls] == ["vox gate says {T AH0 M EY1 T OW2}."]
    # segment.started (what an agent's transcript takes) has the words, not the rules' phonemes
    assert [e["text"] for e in utt.events if e["type"] == "segment.started"] == ["Voxgate says tomato."]

    async with await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream", api_key=B) as c:
        with pytest.raises(ServerError) as e:  # another key's dictionary: as if it did not exist
            await c.start(generation={"pronunciations": [made["pronunciation_id"]]})
        assert e.value.code == "unknown_pronunciation"
    assert (await _post(http, port, A, {"rules": [{"regex": "(", "alias": "x"}]}))[0] == 400
    async with http.delete(f"http://127.0.0.1:{port}/v1/pronunciations/{made['pronunciation_id']}",
                           headers={"Authorization": f"Bearer {B}"}) as r:
        assert r.status == 404
    async with http.delete(f"http://127.0.0.1:{port}/v1/pronunciations/{made['pronunciation_id']}",
                           headers={"Authorization": f"Bearer {A}"}) as r:
        assert r.status == 204


@on_server
async def test_elevenlabs_locators_select_dictionaries(server, engine):
    from elevenlabs import AsyncElevenLabs
    from elevenlabs.core import ApiError

    port, http = server
    sdk = AsyncElevenLabs(api_key=A, base_url=f"http://127.0.0.1:{port}")
    made = await sdk.pronunciation_dictionaries.create_from_rules(  # the ElevenLabs SDK makes it
        name="tomatoes", rules=[{"type": "alias", "string_to_replace": "tomato", "alias": "tomahto"},
                                {"type": "phoneme", "string_to_replace": "basil", "phoneme": "B EY1 Z AH0 L",
                                 "alphabet": "cmu-arpabet"}])
    assert made.version_rules_num == 2
    with pytest.raises(ApiError) as e:
        await sdk.pronunciation_dictionaries.create_from_rules(
            name="ipa", rules=[{"type": "phoneme", "string_to_replace": "a", "phoneme": "ə", "alphabet": "ipa"}])
    assert e.value.status_code == 422 and "cmu-arpabet" in str(e.value.body)
    locators = [{"pronunciation_dictionary_id": made.id, "version_id": made.version_id}]
    url = f"ws://127.0.0.1:{port}/v1/text-to-speech/any/stream-input?output_format=pcm_24000"
    with recorded_calls(engine) as calls:
        async with websockets.connect(url, additional_headers={"xi-api-key": A}) as ws:
            await ws.send(json.dumps({"text": " ", "pronunciation_dictionary_locators": locators}))
            await ws.send('{"text": "A tomato with basil. ", "flush": true}')
            await ws.send('{"text": ""}')
            async for _ in ws:  # to its isFinal and close
                pass
        body = {"text": "One tomato.", "seed": 3, "pronunciation_dictionary_locators": locators,
                "apply_text_normalization": "off"}
        async with http.post(f"http://127.0.0.1:{port}/v1/text-to-speech/any?output_format=pcm_24000", json=body,
                             headers={"xi-api-key": A}) as r:
            assert r.status == 200 and len(await r.read()) > 0
    assert [text for text, _ in calls] == ["A tomahto with {B EY1 Z AH0 L}.", "One tomahto."]
    body["pronunciation_dictionary_locators"] = [{"version_id": "v1"}]
    async with http.post(f"http://127.0.0.1:{port}/v1/text-to-speech/any", json=body, headers={"xi-api-key": A}) as r:
        assert r.status == 422


@on_server
async def test_compat_server_without_keys_keeps_dictionaries_shared(engine):
    async with compat_server(engine) as port, aiohttp.ClientSession() as http:
        status, made = await _post(http, port, "", {"rules": [{"word": "a", "alias": "b"}]})
        assert status == 201
        async with http.get(f"http://127.0.0.1:{port}/v1/pronunciations") as r:
            assert made in (await r.json())["pronunciations"]


@on_server
async def test_phonemes_reach_the_engine_untouched_through_normalisation(server, engine):
    port, _ = server
    with recorded_calls(engine) as calls:
        async with await VoxgateClient.connect(f"ws://127.0.0.1:{port}/v1/stream", api_key=A) as c:
            await c.start(output={"format": "pcm_s16le"}, generation={"seed": 1, "max_length": 2, "normalize": "on"})
            await c.speak("Say {HH AH0 L OW1} 3 times, then {ni3}{hao3}.", "t")
    spoken = " ".join(text for text, _ in calls)
    assert "{HH AH0 L OW1}" in spoken and "{ni3}{hao3}" in spoken and "three" in spoken
