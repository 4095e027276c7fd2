"""``python -m pipeline.cli VERB ...`` (how child processes run verbs)."""

import sys

from pipeline.cli import main

sys.exit(main())
