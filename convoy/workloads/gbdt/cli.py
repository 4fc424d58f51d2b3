"""``convoy gbdt train | update | predict``: orthogonal boosting from CSV or NPZ files.

Input files: a CSV with a header row (the target is the column named by ``--target``, default
``target``; every other column is a feature) or an ``.npz`` with arrays ``X`` (rows x features) and,
for train and update, ``y``. Only the standard library is imported at module level (``convoy
--help`` stays fast); numpy and LightGBM load when a command runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

TASKS = ("regression", "classification")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``gbdt`` sub-commands and their options."""
    commands = parser.add_subparsers(dest="gbdt_command", required=True)
    train = commands.add_parser("train", help="grow orthogonal trees offline and save the model")
    train.add_argument("--data", type=Path, required=True, help="training rows (.csv with header, or .npz with X, y)")
    train.add_argument("--task", choices=TASKS, default="regression", help="squared or logistic loss (default "
                       "%(default)s)")
    train.add_argument("--model", type=Path, required=True, help="where to write the model (JSON)")
    train.add_argument("--learners", type=int, default=200, help="trees to grow (default %(default)s)")
    train.add_argument("--num-leaves", type=int, default=4, help="leaves per tree (default %(default)s)")
    train.add_argument("--min-data-in-leaf", type=int, default=50, help="fewest rows a leaf holds (default "
                       "%(default)s)")
    train.add_argument("--forgetting", type=float, default=0.9998,
                       help="per-row decay of old rows in online updates (default %(default)s)")
    train.add_argument("--threads", type=int, default=2, help="LightGBM threads (default %(default)s)")
    _add_target(train)
    update = commands.add_parser("update", help="learn from new rows as a stream of mini-batches")
    update.add_argument("--model", type=Path, required=True, help="the model to update (rewritten unless --out)")
    update.add_argument("--data", type=Path, required=True, help="new rows (.csv with header, or .npz with X, y)")
    update.add_argument("--batch-rows", type=int, default=1000, help="rows per mini-batch (default %(default)s)")
    update.add_argument("--out", type=Path, default=None, help="write the updated model here instead")
    _add_target(update)
    predict = commands.add_parser("predict", help="write predictions, one per row")
    predict.add_argument("--model", type=Path, required=True, help="a trained model")
    predict.add_argument("--data", type=Path, required=True, help="rows (.csv with header, or .npz with X)")
    predict.add_argument("--out", type=Path, default=None, help="CSV to write (default: stdout)")
    predict.add_argument("--proba", action="store_true", help="classifier: the positive class's probability")
    _add_target(predict)


def _add_target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="target", help="name of the target column in a CSV (default "
                        "%(default)s; ignored by predict's features)")


def run(args: argparse.Namespace) -> int:
    """Execute ``convoy gbdt ...``; user mistakes raise ``GBDTError`` (the CLI prints one line, exit 2)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before LightGBM loads: spinning threads starve 2 cores
    return {"train": _train, "update": _update, "predict": _predict}[args.gbdt_command](args)


def _train(args: argparse.Namespace) -> int:
    from convoy.workloads.gbdt.model import OrthogonalBoostingClassifier, OrthogonalBoostingRegressor

    features, target = read_rows(args.data, args.target, need_target=True)
    estimator = OrthogonalBoostingRegressor if args.task == "regression" else OrthogonalBoostingClassifier
    model = estimator(n_learners=args.learners, num_leaves=args.num_leaves, min_data_in_leaf=args.min_data_in_leaf,
                      forgetting=args.forgetting, num_threads=args.threads)
    model.fit(features, target)
    model.save(args.model)
    print(f"trained {model.n_learners_} learners on {len(target)} rows x {features.shape[1]} features "
          f"(ridge {model.ridge_:g}); wrote {args.model}")
    return 0


def _update(args: argparse.Namespace) -> int:
    from convoy.workloads.gbdt.errors import GBDTError
    from convoy.workloads.gbdt.model import OrthogonalBoosting

    if args.batch_rows < 1:
        raise GBDTError(f"--batch-rows must be >= 1 (got {args.batch_rows})")
    model = OrthogonalBoosting.load(args.model)
    features, target = read_rows(args.data, args.target, need_target=True)
    learners, drifts = model.n_learners_, model.drifts_
    for begin in range(0, len(target), args.batch_rows):
        model.partial_fit(features[begin:begin + args.batch_rows], target[begin:begin + args.batch_rows])
    out = args.out or args.model
    model.save(out)
    print(f"updated on {len(target)} rows: {model.drifts_ - drifts} drift(s) detected, "
          f"{model.n_learners_ - learners} learner(s) added, {model.n_learners_} in all; wrote {out}")
    return 0


def _predict(args: argparse.Namespace) -> int:
    from convoy.workloads.gbdt.errors import GBDTError
    from convoy.workloads.gbdt.model import OrthogonalBoosting, OrthogonalBoostingClassifier

    model = OrthogonalBoosting.load(args.model)
    features, _ = read_rows(args.data, args.target, need_target=False)
    if args.proba:
        if not isinstance(model, OrthogonalBoostingClassifier):
            raise GBDTError("--proba needs a classification model; this one is a regressor")
        values, header = model.predict_proba(features)[:, 1], "probability"
    else:
        values, header = model.predict(features), "prediction"
    lines = [header, *(repr(float(value)) if isinstance(value, float) else str(value) for value in values.tolist())]
    text = "\n".join(lines) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text, encoding="utf-8")
        print(f"wrote {len(values)} predictions to {args.out}")
    return 0


def read_rows(path: Path, target_name: str, need_target: bool) -> tuple[Any, Any]:
    """(features, target or None) from a CSV with a header or an NPZ with ``X`` (and ``y``)."""
    import numpy as np

    from convoy.workloads.gbdt.errors import GBDTDataError

    if not path.is_file():
        raise GBDTDataError(f"no data file at {str(path)!r}")
    if path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as arrays:
                if "X" not in arrays or (need_target and "y" not in arrays):
                    raise GBDTDataError(f"{str(path)!r} must hold arrays 'X'{' and y' if need_target else ''} "
                                        f"(found {sorted(arrays.files)})")
                return arrays["X"], arrays["y"] if "y" in arrays else None
        except (OSError, ValueError) as exc:
            raise GBDTDataError(f"cannot read {str(path)!r} as .npz: {exc}") from exc
    return _read_csv(path, target_name, need_target)


def _read_csv(path: Path, target_name: str, need_target: bool) -> tuple[Any, Any]:
    import csv

    import numpy as np

    from convoy.workloads.gbdt.errors import GBDTDataError

    with path.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle))
    if not rows:
        raise GBDTDataError(f"{str(path)!r} is empty; it needs a header row and data rows")
    header, body = [name.strip() for name in rows[0]], [row for row in rows[1:] if row]
    if need_target and target_name not in header:
        raise GBDTDataError(f"{str(path)!r} has no column {target_name!r} (columns: {', '.join(header)}); "
                            "name the target column with --target")
    try:
        table = np.array([[float(cell) for cell in row] for row in body], dtype=np.float64).reshape(len(body), -1)
    except ValueError as exc:
        raise GBDTDataError(f"{str(path)!r}: every cell must be a number ({exc}); rows must have "
                            f"{len(header)} cells") from exc
    if table.shape[1] != len(header):
        raise GBDTDataError(f"{str(path)!r}: rows have {table.shape[1]} cells but the header names {len(header)}")
    if target_name in header:
        column = header.index(target_name)
        return np.delete(table, column, axis=1), table[:, column]
    return table, None
