"""T(8)/T(1) at b = 1 on the real target (bf16, context 256), measured as 30 pairs of one q = 1 and one
q = 8 forward back to back, so that a phase change of the machine's read rate hits both alike; with the
suite's bf16 kernels (all layers in one call, model.FUSED_LAYERS; then layer by layer through the modules),
with SDPA in place of the attention kernel, and with torch's routes only.
Run it on an idle machine: `python benchmarks/tq_interleaved.py` (docs/performance.md "Session 9")."""
import time, torch, statistics as st
from specbench.engine import cpu_kernels as ck
from specbench.engine.loading import load_model
from specbench.engine.core import forward_new_tokens
from specbench.engine import model as model_module
m = load_model("smollm2-135m", dtype=torch.bfloat16); model = m.model
model.setup_cache(1, 512)
orig = ck.attend_applies
def fwd(q):
    cl = torch.full((1,), 256, dtype=torch.long); tok = torch.randint(0, 49152, (1, q))
    t = time.perf_counter(); forward_new_tokens(model, tok, cl); return time.perf_counter() - t
with torch.inference_mode():
    for mode in ("kernels", "kernels-per-module", "sdpa-attention", "torch-routes", "kernels"):
        model_module.FUSED_LAYERS = mode != "kernels-per-module"
        ck.attend_applies = orig if mode != "sdpa-attention" else (lambda *a: False)
        ck.ENABLED = mode != "torch-routes"
        for _ in range(4): fwd(1); fwd(8)
        t1, t8 = [], []
        for _ in range(30):
            t1.append(fwd(1)); t8.append(fwd(8))
        r = [b / a for a, b in zip(t1, t8)]
        print(f"{mode:18s} T(1) {st.median(t1)*1e3:6.2f} ms  T(8) {st.median(t8)*1e3:6.2f} ms  median pair ratio T(8)/T(1) {st.median(r):.3f}")
ck.ENABLED = True
