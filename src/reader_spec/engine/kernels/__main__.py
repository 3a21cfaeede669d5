"""``python -m reader_spec.engine.kernels``: build the compiled kernel now (``make`` runs this)."""

import sys

from reader_spec.engine.kernels import available, build_directory

if not available():
    sys.exit("reader-spec: the compiled CPU kernels could not be built; the runner will use PyTorch's")
print(f"reader-spec: compiled CPU kernels ready in {build_directory()}")
