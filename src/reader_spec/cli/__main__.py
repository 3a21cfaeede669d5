"""``python -m reader_spec.cli``: the ``reader`` command."""

import sys

from reader_spec.cli import main

sys.exit(main())
