"""Parity of every converted backbone family with its source, as the README's tables.

Runs the parity tests (tests/test_backbones.py and the big_vision SigLIP case of
tests/test_convert.py) and the processor-parity tests (tests/test_processor_parity.py) with
``VIT22B_PARITY_OUT`` set, then prints one markdown row per case: the largest relative error over
its outputs in float32 compute and in bfloat16 compute; then, per source processor, the largest
absolute difference of the normalised pixels from the served preprocessing on each image file
(or why the conversion refuses it).

    python benchmarks/parity.py

The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = [
    "tests/test_backbones.py",
    "tests/test_convert.py::test_big_vision_siglip_image_tower_parity",
    "tests/test_processor_parity.py",
]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "parity.jsonl"
        env = dict(os.environ, VIT22B_PARITY_OUT=str(out))
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS]
        result = subprocess.run(cmd, cwd=ROOT, env=env)
        rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    cases: dict[str, dict] = {}
    processors: dict[str, dict] = {}
    for row in rows:
        if "processor" in row:
            case = processors.setdefault(row["processor"], {"source": row["source"], "images": {}})
            case["images"][row["image"]] = row.get("max_abs", row.get("refused"))
            continue
        case = cases.setdefault(row["case"], {"source": row["source"], "outputs": {}})
        case["outputs"][row["output"]] = (row["f32"], row["bf16"])
    print("| case | source | outputs | float32 (max rel. err.) | bfloat16 (max rel. err.) |")
    print("|---|---|---|---|---|")
    for name, case in cases.items():
        f32 = max(e[0] for e in case["outputs"].values())
        bf16 = max(e[1] for e in case["outputs"].values())
        outputs = ", ".join(case["outputs"])
        print(f"| {name} | {case['source']} | {outputs} | {f32:.1e} | {bf16:.1e} |")
    print()
    print("| processor | source | max abs. difference per image file |")
    print("|---|---|---|")
    for name, case in processors.items():
        figures = [f"{im}: {v:.1e}" for im, v in case["images"].items() if isinstance(v, float)]
        refusals = {v for v in case["images"].values() if isinstance(v, str)}
        cell = "; ".join(figures + [f"refused: {why}" for why in sorted(refusals)])
        print(f"| {name} | {case['source']} | {cell} |")
    print(json.dumps({"returncode": result.returncode, "cases": cases, "processors": processors}))
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
