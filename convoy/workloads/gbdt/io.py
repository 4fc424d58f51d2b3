"""The model file: one UTF-8 JSON object, so that it can be read, diffed and checked by hand. This file owns
the file (writing it atomically, checking its format and version); the estimator (``model.py``) owns the
document inside it (``to_dict``/``from_dict``).

Fields (version 1):

- ``format``: ``"convoy-gbdt"``; ``version``: 1.
- ``estimator``: ``"OrthogonalBoostingRegressor"`` or ``"OrthogonalBoostingClassifier"``.
- ``params``: the constructor's arguments; ``classes``: the classifier's two labels (null for the regressor).
- ``num_features``, ``ridge`` (chosen per-row penalty), ``reference_loss`` (validation loss the drift test is
  relative to), ``rows_seen``, ``drifts``, ``collecting`` (true while rows are being collected to grow on).
- ``online``: ``weights`` (intercept first, then one per tree), ``gram`` (K+1 x K+1), ``moment``, ``rows``,
  ``forgetting``, ``ridge``: the least-squares-with-forgetting state.
- ``drift``: the Page-Hinkley state; ``window``: ``features`` (rows x features) and ``target`` of the rows
  collected since the last detection (empty unless ``collecting``).
- ``trees``: a list of segments, each a LightGBM text model (the offline trees first, then one segment per
  drift-triggered growth); numbering the trees across segments in order, tree k is weighted by
  ``online.weights[k + 1]``. LightGBM's own leaf values are the learner outputs (its learning rate is 1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from convoy.workloads.gbdt.errors import GBDTModelError

FORMAT, VERSION = "convoy-gbdt", 1


def write_document(document: dict[str, Any], path: Path) -> None:
    """Write atomically (a crash mid-save leaves the old file in place), with the format and version."""
    text = json.dumps({"format": FORMAT, "version": VERSION, **document}, allow_nan=False)
    partial = path.with_name(path.name + ".partial")
    try:
        partial.write_text(text, encoding="utf-8")
        partial.replace(path)
    except OSError as exc:
        raise GBDTModelError(f"cannot write the model to {str(path)!r}: {exc}") from exc


def read_document(path: Path) -> dict[str, Any]:
    """The document of a file written by ``write_document``; raise ``GBDTModelError`` naming what is wrong."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise GBDTModelError(f"no model file at {str(path)!r}; train one with `convoy gbdt train`") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GBDTModelError(f"{str(path)!r} is not a readable convoy gbdt model: {exc}") from exc
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise GBDTModelError(f"{str(path)!r} is not a convoy gbdt model (no format {FORMAT!r})")
    if document.get("version") != VERSION:
        raise GBDTModelError(f"{str(path)!r} has model format version {document.get('version')}; this convoy reads "
                             f"version {VERSION}")
    return document
