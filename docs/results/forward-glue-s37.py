"""Scratch (session 37): where a forward's time outside the kernels goes. With
forward-glue-timers-s37.patch applied (two extra stage timers: the layers' loop, s1; the head with
its norm and quantization, s2), `python scripts/build_variant.py glue2`, the patch taken out again,
then `python docs/results/forward-glue-s37.py` from the checkout's root: per row count, medians of
300 forwards after 512 tokens: the wall time, the layers' loop, the head, the layers' loop less the
kernels' own timers inside it (glue_layers), and the rest outside both (Python, the embedding, the
call itself)."""
import statistics
import sys
import time

sys.path.insert(0, '.')
from scripts.kernel_builds import fill, load_build, step, swappable_model

m, use = swappable_model("smollm2-135m", 2)
kb = load_build("specplug_gguf_glue2"); use(kb)
cache = m.new_cache(1, 2048); fill(m, cache, 512)
for k in (1, 4, 8):
    f = step(m, cache, 512, k); f()
    res = []
    for _ in range(300):
        kb.set_stage_timing(True); kb.stage_times()
        t = time.perf_counter(); f(); wall = time.perf_counter() - t
        st = {n: v[0] * 1e3 for n, v in kb.stage_times().items()}; kb.set_stage_timing(False)
        kern = sum(v for n, v in st.items() if n not in ('s1', 's2'))
        res.append(dict(wall=wall * 1e3, layers=st['s1'], head=st['s2'], glue_layers=st['s1'] - (kern - st['s2']), outside=wall * 1e3 - st['s1'] - st['s2']))
    print(k, " ".join(f"{key} {statistics.median(r[key] for r in res):.3f}" for key in res[0]))
