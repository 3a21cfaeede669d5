"""``python -m reader_spec.engine.kernels``: build the compiled kernel now (``make`` runs this)."""

import sys

from reader_spec.engine.kernels import available, build_directory

if not available():
    sys.exit("reader-spec: the compiled CPU kernel could not be built; the runner will use PyTorch's matmul")
print(f"reader-spec: compiled CPU kernel ready in {build_directory()}")
