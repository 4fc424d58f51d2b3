"""`python -m convoy ...` is the same as the `convoy` console script."""

from __future__ import annotations

import sys

from convoy.cli.main import main

sys.exit(main())
