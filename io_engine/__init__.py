"""io_engine: threaded O_DIRECT file I/O into aligned (pinned) host buffers. Knows nothing of optimizers.

from io_engine import IOEngine, IOConfig
with IOEngine(IOConfig(threads=16)) as eng:
    eng.pwrite(tensor, "state.bin").result()
    fut = eng.pread(tensor, "state.bin")   # IOFuture: result(), done(), await
"""

from .align import PAGE, round_up
from .buffers import aligned_empty
from .config import IOConfig
from .duplex import DuplexEngine
from .durable import fsync_dir, write_json_atomic
from .engine import IOEngine, waiting_for_room
from .errors import (
    DirectIOUnsupportedError,
    EngineClosedError,
    EngineForkedError,
    IOEngineError,
    KernelAIOUnavailableError,
    PoolExhaustedError,
    ShortReadError,
)
from .future import IOFuture
from .pool import PinnedBufferPool, PooledBuffer, pool_bytes, waiting_for_buffer
from .serial import SerialEngine
from .shutdown import close_at_exit
from .sizes import format_size, parse_size
from .slab import PinnedSlab

__all__ = [
    "IOConfig",
    "IOEngine",
    "IOFuture",
    "SerialEngine",
    "DuplexEngine",
    "PinnedBufferPool",
    "PooledBuffer",
    "PinnedSlab",
    "IOEngineError",
    "KernelAIOUnavailableError",
    "ShortReadError",
    "DirectIOUnsupportedError",
    "EngineClosedError",
    "EngineForkedError",
    "PoolExhaustedError",
    "aligned_empty",
    "close_at_exit",
    "pool_bytes",
    "PAGE",
    "round_up",
    "fsync_dir",
    "write_json_atomic",
    "format_size",
    "parse_size",
    "waiting_for_room",
    "waiting_for_buffer",
]
