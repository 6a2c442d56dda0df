#!/usr/bin/env bash
# Before/after in one sitting: the tiny-model serving benchmark and the batch-job benchmark,
# alternating two checkouts (each with its own .venv), ROUNDS times. Prints each JSON line.
#   benchmarks/compare_trees.sh OLD_CHECKOUT NEW_CHECKOUT [ROUNDS]
set -euo pipefail
old=$1 new=$2 rounds=${3:-2}
for round in $(seq "$rounds"); do
  for tree in "$old" "$new"; do
    echo "== round $round $tree serve_tiny"
    (cd "$tree" && .venv/bin/python benchmarks/serve.py --model vit-22b-tiny/16 --size 64 \
      --images 256 --repeats 1 2>/dev/null | tail -1)
    echo "== round $round $tree embed"
    (cd "$tree" && .venv/bin/python benchmarks/embed.py --images 512 --repeats 2 2>/dev/null \
      | tail -1)
  done
done
