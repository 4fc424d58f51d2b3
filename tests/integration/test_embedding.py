"""Sharded embeddings on real gloo ranks (checks in tests/fixtures/embedding_check.py): pooled
outputs, loss, dense gradients and updated rows equal one process with ``nn.EmbeddingBag``;
bad ids and bags get clear errors; tables saved by 4 ranks load resharded on 2."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import FIXTURES, ProcessScope

pytestmark = pytest.mark.slow
CHECK = str(FIXTURES / "embedding_check.py")


def test_sharded_tables_train_like_one_process_and_reshard_from_4_to_2(procs: ProcessScope,
                                                                       tmp_path: Path) -> None:
    saved = tmp_path / "tables"
    for world, mode in ((4, "train"), (2, "reload")):
        outputs = procs.gloo_ranks(CHECK, world, [mode, saved])
        for rank, output in enumerate(outputs):
            assert re.search(rf"^rank {rank}: ok \(\d+ checks\)", output, re.MULTILINE), output
    assert sorted(p.name for p in saved.glob("embedding-rank*.pt")) == [f"embedding-rank{r}-of-4.pt" for r in range(4)]
    assert procs.wait_no_leftovers() == []
