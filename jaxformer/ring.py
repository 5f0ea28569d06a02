"""Context parallelism, as it was imported before attention had a package of its own: a re-export.

The ring and all-gather strategies live in `jaxformer.attention.ring`, the kernel inside each block
in `jaxformer.attention.ring_kernels`; `jaxformer.ring.context_attention` and the rest keep working.
"""

from jaxformer.attention.ring import (  # noqa: F401
    Layout,
    allgather_attention,
    cache_attention,
    context_attention,
    layout_order,
    ring_attention,
)
from jaxformer.attention.ring_kernels import (  # noqa: F401
    CAUSAL,
    DENSE,
    FULL,
    FUSED_MASK_VALUE,
    KERNELS,
    KV_FRONT,
    MASKED,
    MASKED_CHUNK,
    NEG,
    Q_BACK,
    SKIP,
    SPLASH_TILE,
    UNSERVABLE,
    BlockKernel,
    Where,
    _splash_calls,
    block_kind,
    cudnn_unservable,
    fused_kernel,
    reference_bwd_call,
    reference_fwd_call,
    splash_unservable,
)
