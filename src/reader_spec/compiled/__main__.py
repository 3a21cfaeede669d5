"""``python -m reader_spec.compiled``: build every compiled part now (``make`` runs this)."""

import logging

from reader_spec.drafters.retrieval import native
from reader_spec.engine import kernels


def main() -> int:
    """1 if a part failed to build."""
    logging.basicConfig(format="reader-spec: %(message)s")
    built = {"fast runner CPU kernels": kernels.available(), "retrieval core": native.core() is not None}
    for part, ok in built.items():
        print(f"reader-spec: {part} {'ready' if ok else 'NOT built (the pure path will run)'}")
    return 0 if all(built.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
