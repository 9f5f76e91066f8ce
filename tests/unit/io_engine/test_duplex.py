"""DuplexEngine: reads through one engine, writes through another, against the serial twin, bitwise."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import TIMEOUT

from io_engine import DuplexEngine, IOConfig, IOEngine, SerialEngine


def payload(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_reads_and_writes_go_to_their_engines_and_match_the_serial_twin(tmp_path):
    cases = [(0, 3 << 20), (5000, 199), (8192, 1 << 20), (1 << 20, 65536 + 3), (0, 4096)]
    reader, writer = IOEngine(IOConfig(threads=4, block_size="64KiB")), IOEngine(IOConfig(threads=2))
    with DuplexEngine(reader, writer) as eng, SerialEngine() as twin:
        futures = []
        for k, (offset, n) in enumerate(cases):
            data = payload(n, seed=k)
            futures.append(eng.pwrite(data, tmp_path / f"d{k}.bin", offset))
            twin.write(data, tmp_path / f"s{k}.bin", offset)
        for f in futures:
            f.result(timeout=TIMEOUT)
        eng.flush()
        for k, (offset, n) in enumerate(cases):
            assert (tmp_path / f"d{k}.bin").read_bytes() == (tmp_path / f"s{k}.bin").read_bytes()
            back = bytearray(n)
            assert eng.pread(back, tmp_path / f"d{k}.bin", offset).result(timeout=TIMEOUT) == n
            assert bytes(back) == payload(n, seed=k)
        r, w, both = reader.stats(), writer.stats(), eng.stats()
    assert r["bytes_written"] == 0 and w["bytes_read"] == 0
    assert r["bytes_read"] == w["bytes_written"] == sum(n for _, n in cases)
    assert both["bytes_read"] == r["bytes_read"] and both["requests"] == r["requests"] + w["requests"]
    with pytest.raises(RuntimeError):  # closed with the duplex: it owned them
        reader.pread(bytearray(1), tmp_path / "d0.bin")


def test_it_refuses_one_engine_twice_or_a_non_engine_and_can_leave_its_engines_open(tmp_path):
    one = SerialEngine()
    with pytest.raises(ValueError, match="same engine"):
        DuplexEngine(one, one)
    with pytest.raises(TypeError, match="writer"):
        DuplexEngine(one, object())  # type: ignore[arg-type]
    other = SerialEngine()
    DuplexEngine(one, other, own=False).close()
    assert one.write(b"x", tmp_path / "x.bin") == 1 and other.read(bytearray(1), tmp_path / "x.bin") == 1
