"""MXFP4 expert weights (GPT-OSS's published checkpoints) dequantized to floats at load.

OCP microscaling FP4: each weight is a 4-bit e2m1 code, two per byte (the low nibble first), and each block of 32
consecutive weights along the input dimension shares one e8m0 scale, a power of two with exponent bias 127:

    w[e, o, 32 g + 2 j]     = FP4[blocks[e, o, g, j] & 0xF] * 2^(scales[e, o, g] - 127)
    w[e, o, 32 g + 2 j + 1] = FP4[blocks[e, o, g, j] >> 4]  * 2^(scales[e, o, g] - 127)

blocks ``[E, out, in / 32, 16]`` uint8 and scales ``[E, out, in / 32]`` uint8 give ``w [E, out, in]``, returned
transposed to ``[E, in, out]``: the ``x @ W`` layout of the unquantized ``gate_up_proj`` / ``down_proj`` tensors.
``dequantize_checkpoint`` replaces every ``{name}_blocks`` / ``{name}_scales`` pair of a checkpoint by ``name``
so dequantized: the models read one layout. Dequantized once at load, the experts then run as any bf16 experts
(no FP4 kernel).
"""

import numpy as np

# e2m1 code -> value: sign bit 3, then 0, 0.5 (subnormal), 1, 1.5, 2, 3, 4, 6.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
SCALE_BIAS = 127  # e8m0
BLOCK = 32  # weights per scale


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``[E, out, in / 32, 16]`` uint8 codes and ``[E, out, in / 32]`` uint8 scales -> ``[E, in, out]`` float32
    (module docstring). Wrong dtypes or shapes -> ValueError naming them."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim != 4 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)}: expected "
                         f"[E, out, groups, {BLOCK // 2}] and [E, out, groups]")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [E, out, groups, 16, 2]: low nibble first
    values = FP4_VALUES[codes].reshape(*scales.shape, BLOCK)
    values = np.ldexp(values, (scales.astype(np.int32) - SCALE_BIAS)[..., None])
    return values.reshape(*scales.shape[:2], -1).transpose(0, 2, 1)


def dequantize_checkpoint(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``tensors`` with each ``{name}_blocks`` / ``{name}_scales`` pair replaced by ``name`` ``[E, in, out]``
    float32 (``dequantize_mxfp4``); a blocks tensor without its scales -> ValueError naming it."""
    pairs = [n.removesuffix("_blocks") for n in tensors if n.endswith("_blocks")]
    if not pairs:
        return tensors
    out = dict(tensors)
    for name in pairs:
        if f"{name}_scales" not in out:
            raise ValueError(f"checkpoint has MXFP4 {name}_blocks but no {name}_scales")
        out[name] = dequantize_mxfp4(out.pop(f"{name}_blocks"), out.pop(f"{name}_scales"))
    return out
