"""What a style instruction adds to a first segment's TTFB: only its own tokens' prefill, nothing else.

Three requests of one text, one after another on an idle engine (interleaved, so drift hits all three alike), each
timed from `generate()` to its first audio chunk:
- `plain`: the text alone;
- `instruction`: the same text with a style instruction (`(instruction)text`);
- `same_tokens`: plain text padded with words to the instruction request's prompt length, without an instruction.
If the instruction costs nothing beyond its tokens, `instruction` equals `same_tokens` (within noise) and exceeds
`plain` by what those extra positions cost in prefill.

    python bench/instruction_ttfb.py                      # the demo model on this machine (CPU: the tiny one)
    python bench/instruction_ttfb.py --model DIR --rounds 200 --json bench/results/instruction_ttfb.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import Engine  # noqa: E402
from engine.prompt import build_final_text, prompt_layout  # noqa: E402

TEXT = "Hello! Thanks for calling, how can I help you today?"
INSTRUCTION = "A warm, friendly young woman, speaking slowly and clearly"


def positions(engine: Engine, text: str, instruction: str | None = None) -> int:
    return len(prompt_layout(engine.config, engine.tokenizer, text, instruction=instruction).token_ids)


def padded_text(engine: Engine, target: int) -> str:
    """TEXT with filler words in front until its prompt is at least `target` positions long."""
    text = TEXT
    while positions(engine, text) < target:
        text = "well " + text
    return text


async def first_chunk_ms(engine: Engine, text: str, instruction: str | None, seed: int) -> float:
    t0 = time.perf_counter()
    stream = engine.generate(text, instruction=instruction, seed=seed, max_length=1, min_length=1)
    try:
        await anext(stream)
        return (time.perf_counter() - t0) * 1000.0
    finally:
        await stream.aclose()


async def main(args: argparse.Namespace) -> dict:
    engine = Engine.from_pretrained(args.model, max_num_seqs=4)
    await engine.wait_for_ready()
    try:
        with_instruction = positions(engine, TEXT, INSTRUCTION)
        variants = {"plain": (TEXT, None), "instruction": (TEXT, INSTRUCTION),
                    "same_tokens": (padded_text(engine, with_instruction), None)}
        for text, instruction in variants.values():  # warm-up: first calls pay one-off costs
            for _ in range(3):
                await first_chunk_ms(engine, text, instruction, 0)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for i in range(args.rounds):
            for name, (text, instruction) in variants.items():
                times[name].append(await first_chunk_ms(engine, text, instruction, i))
        rows = {}
        for name, (text, instruction) in variants.items():
            t = sorted(times[name])
            rows[name] = {"positions": positions(engine, text, instruction), "p50_ms": round(statistics.median(t), 3),
                          "p90_ms": round(t[int(0.9 * (len(t) - 1))], 3), "mean_ms": round(statistics.fmean(t), 3)}
        return {"model": engine.name, "demo": engine.is_demo, "device": engine.model_info().device,
                "machine": platform.processor() or platform.machine(), "rounds": args.rounds,
                "final_text": build_final_text(TEXT, INSTRUCTION), "results": rows}
    finally:
        await engine.stop()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory or Hugging Face id (default: the demo model)")
    p.add_argument("--rounds", type=int, default=60, help="requests per variant")
    p.add_argument("--json", type=Path, help="also write the result here")
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    result = asyncio.run(main(args))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"{'variant':<12} {'positions':>9} {'p50 ms':>8} {'p90 ms':>8}")
    for name, row in result["results"].items():
        print(f"{name:<12} {row['positions']:>9} {row['p50_ms']:>8.2f} {row['p90_ms']:>8.2f}")
