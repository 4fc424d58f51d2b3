"""Sealing and verifying persistent checkpoint directories (no process group needed)."""

from __future__ import annotations

from pathlib import Path

from convoy.runtime.persist import MANIFEST, complete_checkpoints, remove_stale_tmp, step_dir, verify, write_manifest


def _checkpoint(root: Path, step: int) -> Path:
    path = step_dir(root, step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(bytes(range(256)) * 100)
    (path / ".metadata").write_bytes(b"meta" * 10)
    write_manifest(path, step)
    return path


def test_only_sealed_directories_count_newest_first(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 9)
    _checkpoint(tmp_path, 19)
    (tmp_path / "step-000000029.tmp-r1").mkdir()  # a save in flight or crashed
    unsealed = step_dir(tmp_path, 39)
    unsealed.mkdir()
    (unsealed / ".metadata").write_bytes(b"x")  # looks finished to DCP, but has no manifest
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [19, 9]
    remove_stale_tmp(tmp_path)
    assert not (tmp_path / "step-000000029.tmp-r1").exists()


def test_verify_catches_truncation_corruption_and_missing_files(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, 9)
    assert verify(path) is None
    data = path / "__0_0.distcp"
    original = data.read_bytes()
    data.write_bytes(original[:-10])
    assert "truncated" in (verify(path) or "")
    corrupt = bytearray(original)
    corrupt[100] ^= 0xFF
    data.write_bytes(bytes(corrupt))
    assert "checksum" in (verify(path) or "")
    data.unlink()
    assert "missing" in (verify(path) or "")
    (path / MANIFEST).write_text("{not json")
    assert "manifest unreadable" in (verify(path) or "")
