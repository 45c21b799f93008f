"""The CPU rasterizer: numba tile kernels with gsplat's semantics behind a torch autograd Function."""
