"""``python -m pilab ...``: see pilab.cli."""
import sys

from .cli import main

sys.exit(main())
