"""--explain for DDP: ZeRO-0's sentences."""

from toolkit.backends.deepspeed.explain import (  # noqa: F401
    fp32_gradients,
    gradients,
    master_copy,
    one_replica,
    optimizer_offloaded,
    sharding,
    weights,
)
