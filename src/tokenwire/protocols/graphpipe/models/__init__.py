"""Tensor models served over GraphPipe: ONNX graphs (onnxruntime) and the engine's LM."""

# How long an idle intra-op worker spins for more work before it sleeps (microseconds). A call
# is a chain of parallel sections (one per MatMul, ...); a worker that went to sleep between
# them must be woken through the kernel for the next one: ~20 us per section on this machine,
# 0.5 ms per call of the 25-layer benchmark MLP. The gap between two sections is a few us, so
# a 2 us spin bridges most of them, while the worker still sleeps at once after the call and
# leaves the cores to the event loop (onnxruntime's default, much longer spin took them and hurt
# p99 under load). Measured: +8% req/s at concurrency 1, -4% at 16 against no spinning.
DEFAULT_SPIN_US = 2
