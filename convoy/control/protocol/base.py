"""The base of the master's API messages (``messages.py``, ``training.py``, ``shards.py``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Message(BaseModel):
    """A message of the master's API. Its validator is built at its first use, not at import: a process uses a
    few of the API's models, and building all of them at import took each agent and the master about 40 ms
    of CPU as a job starts (``benchmarks/torchrun_lines.py``: on 2 cores the start is bound by CPU)."""

    model_config = ConfigDict(defer_build=True)
