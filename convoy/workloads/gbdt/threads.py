"""Keep numpy's BLAS to one thread while LightGBM's OpenMP threads work between its calls.

On two cores, OpenBLAS threads that spin after a matrix product and LightGBM's OpenMP threads
starting a histogram pass take the CPUs from each other, and every tree takes many times
longer. The products here are small (rows x learners), so one BLAS thread loses little. LightGBM is
loaded through ``lightgbm_module()``, which first asks OpenMP to let idle threads sleep
(``OMP_WAIT_POLICY=passive``, unless the variable is already set): OpenMP reads it once, when it
loads, and spinning idle threads slow everything else on a busy machine.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from functools import lru_cache
from typing import Any, TypeVar

CallableT = TypeVar("CallableT", bound=Callable[..., Any])


def lightgbm_module() -> Any:
    """``import lightgbm``, with OpenMP's idle threads set to sleep if LightGBM is not loaded yet."""
    if "lightgbm" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    import lightgbm

    return lightgbm


@lru_cache(maxsize=1)
def _controller() -> Any:
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # scikit-learn (which brings threadpoolctl) is optional: then run unlimited
        return None
    return ThreadpoolController()


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """Within the block, BLAS runs on one thread (no-op without threadpoolctl)."""
    controller = _controller()
    if controller is None:
        yield
        return
    with controller.limit(limits=1, user_api="blas"):
        yield


def single_blas_thread(function: CallableT) -> CallableT:
    """Decorator: run ``function`` inside ``one_blas_thread()``."""
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with one_blas_thread():
            return function(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
