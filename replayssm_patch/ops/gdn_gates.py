"""The GDN gates as Triton device functions: one definition for every ring kernel (the torch
twin is `gdn_reference.gdn_gating`). Imports only triton."""

import triton
import triton.language as tl


@triton.jit
def gdn_log_decay(a, A_log, dt_bias):
    """g = -exp(A_log) * softplus(a + dt_bias); softplus is the identity above 20, as in vLLM."""
    x = a + dt_bias
    return -tl.exp(A_log) * tl.where(x <= 20.0, tl.log(1.0 + tl.exp(x)), x)


@triton.jit
def gdn_beta(b):
    """beta = sigmoid(b)."""
    return 1.0 / (1.0 + tl.exp(-b))
