import mmap, os, sys, time, torch, ctypes
sys.path.insert(0, os.getcwd())
from io_engine import IOEngine, IOConfig
SIZE = int(sys.argv[1]) << 20
REQ = 64 << 20
def buf(flags, advise):
    m = mmap.mmap(-1, SIZE + (2 << 20), flags=flags)
    a = ctypes.c_char.from_buffer(m); addr = ctypes.addressof(a); del a
    off = -addr % (2 << 20)
    if advise: m.madvise(mmap.MADV_HUGEPAGE, off, SIZE)
    t = torch.frombuffer(m, dtype=torch.uint8)[off:off + SIZE]
    t.fill_(7)
    return m, t
path = os.environ.get("DIR", ".") + "/host_buffers.bin"
with open(path, "wb") as f: f.truncate(SIZE)
bufs = {"shared": buf(mmap.MAP_SHARED, False), "shared+adv": buf(mmap.MAP_SHARED, True),
        "private": buf(mmap.MAP_PRIVATE, False), "private+adv": buf(mmap.MAP_PRIVATE, True)}
print([l.strip() for l in open("/proc/meminfo") if "AnonHuge" in l])
eng = IOEngine(IOConfig(threads=int(sys.argv[2]) if len(sys.argv) > 2 else 64, block_size=1 << 20, direct="on"))
def run(t, write):
    op = eng.pwrite if write else eng.pread
    t0 = time.perf_counter()
    for f in [op(t[o:o+REQ], path, o) for o in range(0, SIZE, REQ)]: f.result()
    return SIZE / (time.perf_counter() - t0) / 1e9
run(bufs["shared"][1], True)
res = {k: [] for k in bufs}
names = list(bufs)
for r in range(4):
    for k in (names if r % 2 == 0 else names[::-1]):
        w = run(bufs[k][1], True); rd = run(bufs[k][1], False)
        res[k].append((round(w, 2), round(rd, 2)))
for k, v in res.items(): print(f"{k:12s}", v)
eng.close(); os.unlink(path)
