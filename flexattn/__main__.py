"""``python -m flexattn ...``: the ``flexattn`` command (`flexattn.cli`)."""

import sys

from flexattn.cli import main

sys.exit(main())
