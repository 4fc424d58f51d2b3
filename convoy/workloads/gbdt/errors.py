"""What a user can get wrong with the online GBDT: bad data, mismatched shapes, unusable files."""

from __future__ import annotations

from convoy.errors import ConvoyError


class GBDTError(ConvoyError):
    """Base class of the gbdt workload's user errors (the CLI prints one line and exits with 2)."""


class GBDTDataError(GBDTError):
    """Features or targets are unusable: NaN/inf, wrong shape, empty, or not binary for a classifier."""


class GBDTModelError(GBDTError):
    """A model is used before it is fitted, or a model file is missing, corrupt or of another version."""
