"""apex-jax: compact-state fused AdamW (ApexW) for JAX, as an optax transform and a fused in-place step."""

from apex_jax.flat import FlatLayout, FlatParams, RowSharding, flatten
from apex_jax.transform import (
    IMPLEMENTATIONS,
    STATE_DTYPES,
    ApexW,
    ApexWState,
    DenseMoments,
    QuantizedMoments,
    apexw,
    state_nbytes,
)

__all__ = [
    "IMPLEMENTATIONS",
    "STATE_DTYPES",
    "ApexW",
    "ApexWState",
    "DenseMoments",
    "FlatLayout",
    "FlatParams",
    "QuantizedMoments",
    "RowSharding",
    "apexw",
    "flatten",
    "state_nbytes",
]
