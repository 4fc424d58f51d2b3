"""convoy: automatic, elastic distributed training for PyTorch.

The control plane (``convoy.control``, ``convoy.agent``) never imports torch, so importing
this package is cheap; the worker-side API is added by ``convoy.runtime``.
"""

from __future__ import annotations

__version__ = "0.1.0"
