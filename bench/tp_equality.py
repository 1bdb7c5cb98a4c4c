"""TP=2 vs TP=1 on the same checkpoint: relative error of the patches (bf16 tolerance).

    python bench/tp_equality.py MODEL_DIR OUT.json
"""

import asyncio
import json
import sys

import numpy as np

from engine import Engine

TEXT = "Tensor parallel output has to match the single GPU, patch for patch."


async def run(model: str, devices: list[int], tp: int) -> list[tuple[np.ndarray, np.ndarray]]:
    eng = Engine(model, devices=devices, tensor_parallel_size=tp, max_num_seqs=8, gpu_memory_utilization=0.5)
    await eng.wait_for_ready()

    async def one(seed: int) -> tuple[np.ndarray, np.ndarray]:
        chunks = [c async for c in eng.generate(TEXT, seed=seed, max_length=8, min_length=8)]
        return np.stack([c.latents for c in chunks]), np.concatenate([c.audio for c in chunks])

    res = await asyncio.gather(*(one(s) for s in range(4)))
    await eng.stop()
    return res


def main() -> None:
    model, out = sys.argv[1], sys.argv[2]
    tp1 = asyncio.run(run(model, [0], 1))
    tp2 = asyncio.run(run(model, [0, 1], 2))
    rel = [[float(np.linalg.norm(b[i] - a[i]) / np.linalg.norm(a[i])) for i in range(len(a))]
           for (a, _), (b, _) in zip(tp1, tp2, strict=True)]
    first = max(r[0] for r in rel)
    result = {"patch_rel_err": rel, "first_patch_max_rel_err": first, "tolerance": 0.05, "ok": first < 0.05,
              "first_patch_audio_max_abs": max(float(np.abs(a2[:len(a2) // 8] - a1[:len(a1) // 8]).max())
                                               for (_, a1), (_, a2) in zip(tp1, tp2, strict=True))}
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "patch_rel_err"}))


if __name__ == "__main__":  # spawned workers re-import this module: run only as the script
    main()
