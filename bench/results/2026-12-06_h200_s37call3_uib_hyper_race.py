"""update_in_backward: a hyperparameter set between loss.backward() and opt.step() (manual LR warmup) is
ignored for chunks whose early update was running when it was set: StartedUpdate.hyper is captured after
the update read the group. Compares against torch.optim.AdamW(fused=True), bitwise. CPU stand-in:
 update_in_backward=True (the GPU default path)."""
import copy, sys, tempfile, warnings
sys.path.insert(0, ".")
import torch
from torch import nn
from tiered import TieredOptimizer
warnings.simplefilter("ignore")

def run(key, new):
    torch.manual_seed(0)
    ref = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]).cuda()
    model = copy.deepcopy(ref)
    ro = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    with TieredOptimizer(list(model.parameters()), tempfile.mkdtemp(), lr=1e-2, 
                         update_in_backward=True, host_budget="4MiB", chunk_bytes="12KiB") as to:
        for i in range(4):
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(i)).cuda()
            for m, o in ((ref, ro), (model, to)):
                m(x).square().mean().backward()
                o.param_groups[0][key] = new(i)   # e.g. manual warmup: set lr after backward, before step
                o.step(); o.zero_grad()
    bad = [n for (n, a), b in zip(ref.named_parameters(), model.parameters()) if not torch.equal(a, b)]
    return bad

fails = 0
for key, new in (("lr", lambda i: 1e-2 * (i + 1) / 4), ("eps", lambda i: 10.0 ** -(3 + i)),
                 ("weight_decay", lambda i: 0.1 * i)):
    bad = run(key, new)
    print(("FAIL" if bad else "OK"), f"{key} set between backward and step:", bad[:4])
    fails += bool(bad)
print("FAIL" if fails else "OK")
