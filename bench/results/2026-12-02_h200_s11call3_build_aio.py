import time
t = time.perf_counter()
from deepspeed.ops.op_builder import AsyncIOBuilder
AsyncIOBuilder().load()
print(f"aio op built in {time.perf_counter() - t:.1f} s", flush=True)
