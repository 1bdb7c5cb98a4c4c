"""Records what the segmenter releases over tests/segmenter_cases.py's corpus into tests/data/segments.json.gz: the
reference tests/test_segmenter_cases.py holds the checkout's segmenter to. Recorded from the main branch's code (the
segmenter before a change that must not change its answers), by putting main's tree first on the path:

    git worktree add --detach /tmp/main-tree main
    PYTHONPATH=/tmp/main-tree python tests/data/record_segments.py
    git worktree remove /tmp/main-tree
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path += [str(HERE.parent), str(HERE.parent.parent)]  # segmenter_cases, bench: after PYTHONPATH's gateway

from segmenter_cases import traces  # noqa: E402

import gateway.text.segmenter  # noqa: E402

OUT = HERE / "segments.json.gz"


def main() -> None:
    source = Path(gateway.text.segmenter.__file__).resolve().parents[2]
    commit = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    recorded = traces()
    with gzip.open(OUT, "wt", encoding="utf-8") as f:
        json.dump({"segmenter_from": str(source), "commit": commit.strip() or None, "cases": recorded}, f,
                  ensure_ascii=False, separators=(",", ":"))
    print(f"{len(recorded)} cases from the segmenter in {source} -> {OUT}")


if __name__ == "__main__":
    main()
