"""Voice design: a stored voice made from a description instead of recorded audio.

The description is a style instruction (`(description)sample text`, VoxCPM2's voice design); the sample it makes
is generated once and its latents become the stored voice (a reference voice on VoxCPM2, a prompt voice with the
sample text as its transcript on VoxCPM 0.5B/1.5), so every later turn with the voice id sounds the same, as
ElevenLabs' voice design makes a voice from a description. The latents are the model's own, so no audio is decoded
and encoded again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gateway.protocol import MAX_INSTRUCTION_CHARS, ProtocolError, load_json

DEFAULT_SAMPLE_TEXT = ("Hello! This is the voice you described. I can read anything you write, and I will sound "
                       "like this every time.")
MAX_SAMPLE_CHARS = 500
FIELDS = ("description", "text", "seed", "public")


@dataclass(frozen=True)
class Design:
    """What `POST /v1/voices` with a JSON body asks for."""

    description: str
    text: str = DEFAULT_SAMPLE_TEXT  # the sample spoken with the description: what the voice is made of
    seed: int | None = None  # same seed + description + text -> the same voice
    public: bool = False


def parse_design(body: bytes) -> Design:
    """A JSON body `{"description", "text"?, "seed"?, "public"?}`; ValueError naming what is wrong."""
    try:
        data = load_json(body)
    except ProtocolError as e:  # not JSON, or strings that are not valid Unicode
        raise ValueError(e.message) from None
    if not isinstance(data, dict):
        raise ValueError("send a JSON object: {\"description\": \"warm female voice\", \"text\": \"...\"}")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(unknown)}; known: {', '.join(FIELDS)}")
    description, text = data.get("description"), data.get("text", DEFAULT_SAMPLE_TEXT)
    if not isinstance(description, str) or not description.strip() or len(description) > MAX_INSTRUCTION_CHARS:
        raise ValueError(f"description must be a non-empty string of at most {MAX_INSTRUCTION_CHARS} characters")
    if not isinstance(text, str) or not text.strip() or len(text) > MAX_SAMPLE_CHARS:
        raise ValueError(f"text (the sample spoken) must be a non-empty string of at most {MAX_SAMPLE_CHARS} "
                         "characters")
    seed = data.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise ValueError("seed must be null or an integer in [0, 2^63)")
    public = data.get("public", False)
    if not isinstance(public, bool):
        raise ValueError("public must be a boolean")
    return Design(description.strip(), text.strip(), seed, public)


async def design_latents(engine: Any, design: Design, tenant: str | None = None) -> np.ndarray:
    """Speak the sample with the description as its instruction: its patches [T, P, D] (engine errors pass). The
    request is the caller's `tenant`'s, shared fairly with other keys' like its turns."""
    stream = engine.generate(design.text, instruction=design.description, seed=design.seed, tenant=tenant)
    try:
        patches = [np.asarray(chunk.latents) async for chunk in stream]
    finally:
        await stream.aclose()
    return np.stack(patches).astype(np.float32)
