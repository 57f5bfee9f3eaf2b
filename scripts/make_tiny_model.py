"""Write a tiny, randomly initialised causal-LM checkpoint to a local directory (stagemesh.tiny_model).

Usage::

    python scripts/make_tiny_model.py OUT --family llama|mistral|qwen2 [--layers N] ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, installed or not

from stagemesh.tiny_model import DTYPES, FAMILIES, make_tiny_model  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="output directory")
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--max-position", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--sliding-window", type=int, default=None,
                        help="attend to at most this many positions in every layer (mistral, qwen2)")
    parser.add_argument("--tie-word-embeddings", action="store_true", help="the LM head is the embedding matrix")
    args = parser.parse_args(argv)
    try:
        make_tiny_model(
            args.out,
            args.family,
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate=args.intermediate,
            vocab=args.vocab,
            max_position=args.max_position,
            seed=args.seed,
            dtype=args.dtype,
            sliding_window=args.sliding_window,
            tie_word_embeddings=args.tie_word_embeddings,
        )
    except ValueError as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    main()
