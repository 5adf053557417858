"""``python3 -m hf_megatrain train ...``: the same as the ``hf-megatrain`` command."""

import sys

from .cli import main

sys.exit(main())
