"""Gradient-boosted trees that keep learning online: orthogonal base learners, streaming weights, drift-triggered
growth (see README.md in this folder)."""

from __future__ import annotations

from convoy.workloads.gbdt.errors import GBDTDataError, GBDTError, GBDTModelError
from convoy.workloads.gbdt.model import OrthogonalBoostingClassifier, OrthogonalBoostingRegressor

__all__ = ["GBDTDataError", "GBDTError", "GBDTModelError", "OrthogonalBoostingClassifier",
           "OrthogonalBoostingRegressor"]
