"""Property test: random pwrite/pread programs give byte-identical results on `IOEngine` and its serial twin
`SerialEngine` (and on a plain in-memory model of the file), for random engine configurations.

A program is a list of batches. In a batch the writes cover disjoint ranges and are all in flight at
once; after flush() the reads are all in flight at once. Overlapping writes in one batch would have no
defined order, so they are dropped rather than compared.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers import TIMEOUT, odirect_512_supported
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from io_engine import IOConfig, IOEngine, SerialEngine, aligned_empty
from io_engine.errors import ShortReadError
from io_engine.kernel_aio import unavailable_reason

MiB = 2**20
MAX_SIZE = MiB
MAX_OFFSET = 2 * MiB
EDGES = [0, 1, 511, 4095, 4096, 4097, 65535, 65536, MiB - 1, MiB, MiB + 1]


def payload(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def odirect_supported(directory) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = os.path.join(directory, ".odirect_probe")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


offsets = st.one_of(st.sampled_from(EDGES), st.integers(0, MAX_OFFSET))
sizes = st.one_of(st.sampled_from([1, 4095, 4096, 4097, MiB]), st.integers(1, MAX_SIZE))
# "aligned": page-aligned memory, so whole tasks go direct (and, with submit="aio", through kernel AIO).
kinds = st.sampled_from(["bytearray", "numpy", "torch", "aligned"])
SUBMITS = ["threads"] if unavailable_reason() else ["threads", "aio"]
write_op = st.tuples(st.just("w"), offsets, sizes, st.integers(0, 2**32 - 1), kinds)
read_op = st.tuples(st.just("r"), offsets, sizes, st.just(0), kinds)
batches = st.lists(st.lists(st.one_of(write_op, read_op), min_size=1, max_size=6), min_size=1, max_size=4)
configs = st.fixed_dictionaries(
    {
        "threads": st.sampled_from([1, 2, 4, 16]),
        "block_size": st.sampled_from([4096, 8192, 65536, MiB]),
        "queue_depth": st.sampled_from([1, 4, 32, 128]),
        "direct": st.sampled_from(["off", "auto", "on"]),
        "alignment": st.sampled_from([512, 4096]),
        "submit": st.sampled_from(SUBMITS),
    }
)


def make_buffer(kind: str, data: bytes | None, n: int):
    """A buffer of n bytes (holding data when given) of the requested type."""
    if kind == "bytearray":
        return bytearray(data) if data is not None else bytearray(n)
    if kind == "numpy":
        return np.frombuffer(bytearray(data), dtype=np.uint8) if data is not None else np.zeros(n, np.uint8)
    if kind == "aligned":  # a view of an anonymous mmap, zero-filled; the view keeps the map alive
        out = torch.frombuffer(aligned_empty(n, 4096)[0], dtype=torch.uint8)
        if data is not None:
            out.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return out
    if data is not None:
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return torch.zeros(n, dtype=torch.uint8)


def as_bytes(buf) -> bytes:
    if isinstance(buf, torch.Tensor):
        return buf.numpy().tobytes()
    if isinstance(buf, np.ndarray):
        return buf.tobytes()
    return bytes(buf)


def disjoint_writes(batch):
    taken: list[tuple[int, int]] = []
    out = []
    for op in batch:
        if op[0] != "w":
            continue
        _, off, n, _, _ = op
        if all(off + n <= s or e <= off for s, e in taken):
            taken.append((off, off + n))
            out.append(op)
    return out


def run_program(engine, path: str, program) -> list:
    """Apply the program; return one outcome per read: (count, bytes) or ('short', expected, found)."""
    outcomes = []
    for batch in program:
        futs = [
            engine.pwrite(make_buffer(kind, payload(n, seed), n), path, off)
            for _, off, n, seed, kind in disjoint_writes(batch)
        ]
        engine.flush()
        assert all(f.done() for f in futs)
        assert [f.result(timeout=TIMEOUT) for f in futs] == [op[2] for op in disjoint_writes(batch)]
        reads = []
        for op in batch:
            if op[0] == "r":
                _, off, n, _, kind = op
                buf = make_buffer(kind, None, n)
                reads.append((buf, engine.pread(buf, path, off)))
        for buf, fut in reads:
            try:
                count = fut.result(timeout=TIMEOUT)
            except ShortReadError as exc:
                outcomes.append(("short", exc.expected, exc.found))
            else:
                outcomes.append((count, as_bytes(buf)))
    return outcomes


def model_program(program) -> tuple[bytes, list]:
    """The same program on a bytearray: what the file and every read must hold."""
    data = bytearray()
    outcomes = []
    for batch in program:
        for _, off, n, seed, _ in disjoint_writes(batch):
            if len(data) < off + n:
                data.extend(bytes(off + n - len(data)))
            data[off : off + n] = payload(n, seed)
        for op in batch:
            if op[0] == "r":
                _, off, n, _, _ = op
                avail = max(0, min(n, len(data) - off))
                if avail < n:
                    outcomes.append(("short", n, avail))
                else:
                    outcomes.append((n, bytes(data[off : off + n])))
    return bytes(data), outcomes


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(cfg=configs, program=batches)
def test_engine_matches_serial_twin_and_model(tmp_path_factory, cfg, program):
    root = tmp_path_factory.mktemp("prop")
    if cfg["direct"] == "on" and not odirect_supported(root):
        cfg = {**cfg, "direct": "auto"}
    if cfg["alignment"] == 512 and not odirect_512_supported(root):
        cfg = {**cfg, "alignment": 4096}
    a, b = os.path.join(root, "engine.bin"), os.path.join(root, "serial.bin")
    for p in (a, b):
        open(p, "wb").close()  # reads before the first write are short reads, not missing files
    with IOEngine(IOConfig(**cfg)) as eng, SerialEngine() as ser:
        got = run_program(eng, a, program)
        want = run_program(ser, b, program)
    model_file, model_reads = model_program(program)

    def file_bytes(p):
        with open(p, "rb") as f:
            return f.read()

    assert file_bytes(b) == model_file, "the serial twin disagrees with the model"
    assert want == model_reads, "the serial twin's reads disagree with the model"
    assert file_bytes(a) == file_bytes(b), f"files differ for config {cfg}"
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"read {i} differs for config {cfg}: {g[:1]} vs {w[:1]}"


@pytest.mark.parametrize("seed", range(3))
def test_interleaved_blocking_calls_match_serial(tmp_path, seed):
    # Blocking read()/write() with overlapping ranges: the order is the call order.
    rng = np.random.default_rng(seed)
    a, b = str(tmp_path / "a.bin"), str(tmp_path / "b.bin")
    for p in (a, b):
        open(p, "wb").close()
    with IOEngine(IOConfig(threads=4, block_size=4096, direct="auto")) as eng, SerialEngine() as ser:
        for step in range(40):
            off = int(rng.integers(0, 300_000))
            n = int(rng.integers(1, 70_000))
            if rng.random() < 0.6:
                data = payload(n, seed * 1000 + step)
                assert eng.write(data, a, off) == ser.write(data, b, off) == n
            else:
                x, y = bytearray(n), bytearray(n)
                try:
                    want = ser.read(y, b, off)
                except ShortReadError as exc:
                    with pytest.raises(ShortReadError) as info:
                        eng.read(x, a, off)
                    assert (info.value.expected, info.value.found) == (exc.expected, exc.found)
                else:
                    assert eng.read(x, a, off) == want
                    assert x == y
        eng.flush()
    with open(a, "rb") as fa, open(b, "rb") as fb:
        assert fa.read() == fb.read()
