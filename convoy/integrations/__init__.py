"""Drop-in hooks for training frameworks: each module imports its framework only when imported itself,
so ``import convoy`` stays free of them (``convoy.integrations.transformers`` needs ``transformers``)."""

from __future__ import annotations
