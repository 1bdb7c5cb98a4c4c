"""Durable local state (issue 29): voices and a LoRA adapter stored through `voxgate serve --data-dir`, the process
killed with SIGKILL (also in the middle of uploads), started again: every acknowledged voice is listed for its
owner only and speaks exactly the same audio (same seed); an upload cut off is absent, not corrupt."""

import asyncio
import json

import aiohttp
import pytest
import torch
from safetensors.torch import save
from store_support import Node, bearer, post_voice, speak, voice_ids, wav

from gateway.store.local import LocalStore

pytestmark = [pytest.mark.timeout(240)]

A, B = "key-a", "key-b"


def _adapter(tiny_v2_dir) -> bytes:
    from engine.config import ModelConfig
    from engine.lora import lora_layout

    torch.manual_seed(3)
    layout = lora_layout(ModelConfig.from_file(tiny_v2_dir / "config.json"))
    return save({f"{path}.lora_{ab}": 0.05 * torch.randn(*(2, fan_in) if ab == "A" else (fan_out, 2))
                 for path, (fan_in, fan_out) in list(layout.items())[:4] for ab in "AB"})


async def _cut_off_upload(node: Node) -> None:
    """Headers and part of a voice body, the rest never sent: the server is mid-upload when it dies."""
    _, writer = await asyncio.open_connection("127.0.0.1", node.port)
    body = wav(seconds=2.0)
    writer.write(f"POST /v1/voices HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {A}\r\nContent-Type: audio/wav\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body[: len(body) // 2])
    await writer.drain()


async def test_acknowledged_voices_survive_kill_9(tiny_v2_dir, tmp_path):
    data, keys = tmp_path / "data", tmp_path / "keys"
    keys.write_text(f"{A}\n{B}\n")
    args = ("--data-dir", str(data), "--api-keys-file", str(keys), "--max-loras", "2", "--max-lora-rank", "4")
    node = await Node.start(tiny_v2_dir, *args)
    try:
        async with aiohttp.ClientSession() as http:
            form = aiohttp.FormData()
            form.add_field("name", "style")
            form.add_field("config", json.dumps({"r": 2, "alpha": 4}))
            form.add_field("weights", _adapter(tiny_v2_dir), filename="lora_weights.safetensors")
            async with http.post(f"{node.http}/v1/loras", data=form, headers=bearer(A)) as r:
                assert r.status == 201, await r.text()
            plain = await post_voice(http, node, A, text="A plain voice.")
            styled = await post_voice(http, node, A, lora="style")
            before = {v: await speak(node, A, "Same words and the same seed", voice=v) for v in (plain, styled)}
            assert all(before.values()) and before[plain] != before[styled]
            # a burst of uploads with SIGKILL as soon as the first is acknowledged, and one cut off mid-body
            await _cut_off_upload(node)
            uploads = [asyncio.ensure_future(http.post(f"{node.http}/v1/voices", data=wav(hz=200 + 20 * i),
                                                       headers=bearer(A))) for i in range(4)]
            done, _ = await asyncio.wait(uploads, return_when=asyncio.FIRST_COMPLETED)
            await node.kill()
            acknowledged = {plain, styled}
            for task in uploads:
                response = await asyncio.gather(task, return_exceptions=True)
                if isinstance(response[0], aiohttp.ClientResponse) and response[0].status == 201:
                    acknowledged.add((await response[0].json())["voice_id"])
            assert len(acknowledged) >= 3  # the first one finished before the kill

        node = await Node.start(tiny_v2_dir, *args)
        assert any("restored" in line for line in node.log), "".join(node.log)  # progress in the log
        async with aiohttp.ClientSession() as http:
            listed = await voice_ids(http, node, A)
            assert acknowledged <= set(listed)
            assert len(listed) <= len(acknowledged) + 3  # the cut-off upload is not among them
            assert await voice_ids(http, node, B) == []  # owners are kept too
            async with http.get(f"{node.http}/v1/loras", headers=bearer(A)) as r:
                assert [x["name"] for x in (await r.json())["loras"]] == ["style"]
            for voice in listed:  # every listed voice is whole: it speaks
                assert await speak(node, A, "Whole.", voice=voice)
        for voice, audio in before.items():
            assert await speak(node, A, "Same words and the same seed", voice=voice) == audio
    finally:
        await node.kill()


def test_unfinished_writes_are_removed_at_start(tmp_path):
    """What a crash in the middle of a write leaves (a staging folder) is never loaded and is cleaned up."""
    staging = tmp_path / "tmp" / "0123"
    staging.mkdir(parents=True)
    (staging / "blob-latents").write_bytes(b"half a voice")
    store = LocalStore(tmp_path)
    assert not any((tmp_path / "tmp").iterdir())
    assert asyncio.run(store.items("voice")) == []
