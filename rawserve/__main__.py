"""`python -m rawserve`: the `rawserve` command (rawserve/cli.py). `python -m rawserve --model-dir DIR` serves."""
from __future__ import annotations

import sys

from rawserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
