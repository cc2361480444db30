"""How the kernel tests run their kernels: compiled through Triton on a GPU, in Pallas interpret mode elsewhere.

Interpret mode computes in float32 like the jnp reference, so the two agree to float32 rounding. On a GPU, XLA's
float32 matmuls default to tf32, so the references are pinned to full float32 here; Triton's float32 dots in the
kernels round their operands to tf32 (unit roundoff 2**-11, about 4.9e-4): on these tests' O(1) random scores
that is an absolute error near 1e-3 in the scores, hence in the log-sum-exp and the outputs, and 5e-3 leaves a
margin of five. bfloat16 operands multiply exactly into float32 on both sides, so those tests keep their bounds.
"""

import jax

ON_GPU = jax.default_backend() == "gpu"
IMPL = "kernel" if ON_GPU else "interpret"
TOL = dict(rtol=5e-3, atol=5e-3) if ON_GPU else dict(rtol=1e-5, atol=1e-5)
if ON_GPU:
    jax.config.update("jax_default_matmul_precision", "highest")  # the references in float32, not tf32
