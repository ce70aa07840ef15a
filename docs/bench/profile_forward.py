"""Where a target forward's time goes at 1 and 5 new tokens, float32 and bfloat16 (one thread). Run: python docs/bench/profile_forward.py"""
import torch
from torch.profiler import profile
from verispec.models.native import load_model
from verispec.models.timing import forward_seconds
torch.set_num_threads(1)
for dtype in ("float32", "bfloat16"):
    t = load_model("models/stdlib-target", dtype=dtype)
    ms = {n: forward_seconds(t, n, repeats=15) * 1e3 for n in (1, 2, 3, 5, 9)}
    print(dtype, "forward ms by new tokens:", {n: round(v, 2) for n, v in ms.items()})
    for n in (1, 5):
        cache = t.new_cache(600)
        t(torch.arange(256)[None] % 8000, cache)
        x = torch.arange(n)[None]
        for _ in range(3):
            t(x, cache); cache.truncate(256)
        with profile() as prof:
            for _ in range(20):
                t(x, cache); cache.truncate(256)
        ev = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in ev)
        mm = sum(e.self_cpu_time_total for e in ev if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
        attn = sum(e.self_cpu_time_total for e in ev if "scaled_dot_product" in e.key)
        print(f"  {dtype} n={n}: matmul {mm / total:.0%} of self CPU time, attention {attn / total:.0%}, rest {1 - (mm + attn) / total:.0%}")
d = load_model("models/stdlib-draft")
print("draft forward ms (1 token):", round(forward_seconds(d, 1, repeats=15) * 1e3, 2))
p = sum(x.numel() for x in d.module.parameters()); e = d.module.model.embed_tokens.weight.numel()
print(f"draft parameters {p/1e6:.2f}M, of which embedding/head (tied) {e/1e6:.2f}M")
