"""``python -m hf_paged``: the ``hf-paged`` command."""

import sys

from .cli import main

sys.exit(main())
