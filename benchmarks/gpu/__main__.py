"""``python -m benchmarks.gpu``: the GPU benchmark (see the package's docstring)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
