"""megatron_mugrpo.durable: atomic writes that leave nothing half-written, checksums that name their algorithm."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest

from megatron_mugrpo import durable
from megatron_mugrpo.durable import Checksum, ChecksumError


def test_atomic_write_leaves_only_the_file(tmp_path: Path) -> None:
    path = tmp_path / "record.bin"
    durable.atomic_write_bytes(path, b"first")
    durable.atomic_write_bytes(path, b"second")
    assert path.read_bytes() == b"second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.bin"]


def test_json_round_trip(tmp_path: Path) -> None:
    value = {"b": [1, 2.5, None], "a": {"nested": "ü"}}
    path = tmp_path / "value.json"
    durable.atomic_write_json(path, value, sort_keys=True)
    assert json.loads(path.read_text()) == value
    assert path.read_text().endswith("}\n") and path.read_text().index('"a"') < path.read_text().index('"b"')


def test_a_failed_rename_keeps_the_old_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "pointer"
    durable.atomic_write_text(path, "old\n")

    def fail(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        durable.atomic_write_text(path, "new\n")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pointer"]  # the temporary is removed


def test_a_failure_while_writing_keeps_the_old_content(tmp_path: Path) -> None:
    path = tmp_path / "shard.arrow"
    durable.atomic_write_bytes(path, b"complete shard")
    with pytest.raises(RuntimeError, match="killed"), durable.atomic_path(path) as tmp:
        tmp.write_bytes(b"half a sh")
        raise RuntimeError("killed mid-write")
    assert path.read_bytes() == b"complete shard"
    assert not durable.temporary_path(path).exists()


def test_atomic_path_fsyncs_the_file_then_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(durable, "fsync_file", lambda p: calls.append(f"file {Path(p).name}"))
    monkeypatch.setattr(durable, "fsync_dir", lambda p: calls.append(f"dir {Path(p).name}"))
    with durable.atomic_path(tmp_path / "data") as tmp:
        tmp.write_bytes(b"x")
    assert calls == ["file data.tmp", f"dir {tmp_path.name}"]


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
def test_checksums_of_both_algorithms_verify(tmp_path: Path, algorithm: str) -> None:
    path = tmp_path / "data"
    data = os.urandom(3 * durable.HASH_CHUNK_BYTES + 17)  # several chunks and a remainder
    path.write_bytes(data)
    checksum = Checksum.of_file(path, algorithm)
    assert checksum == Checksum.of_bytes(data, algorithm)
    assert Checksum.from_json(asdict(checksum)) == checksum
    checksum.verify_file(path)
    assert durable.file_checksum(path, algorithm) == (checksum, len(data))


def test_new_checksums_are_xxh3_and_sha256_records_still_verify(tmp_path: Path) -> None:
    path = tmp_path / "shard"
    path.write_bytes(b"groups")
    assert Checksum.of_file(path).algorithm == "xxh3_128"
    legacy = {"index": 0, "sha256": hashlib.sha256(b"groups").hexdigest()}  # a record of an earlier version
    checksum, rest = Checksum.split_record(legacy)
    assert checksum.algorithm == "sha256" and rest == {"index": 0}
    checksum.verify_file(path)


def test_a_mismatched_checksum_names_file_and_algorithm(tmp_path: Path) -> None:
    path = tmp_path / "shard"
    path.write_bytes(b"groups")
    checksum = Checksum.of_file(path)
    path.write_bytes(b"grOups")
    with pytest.raises(ChecksumError, match=r"shard .*shard does not match its recorded xxh3_128 checksum"):
        checksum.verify_file(path, "shard")


def test_an_unknown_algorithm_is_refused() -> None:
    with pytest.raises(ChecksumError, match="'md5' is not one of"):
        Checksum("md5", "00")
    with pytest.raises(ChecksumError, match="not a checksum record"):
        Checksum.from_json({"hexdigest": "00"})
