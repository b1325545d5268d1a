"""Block-scaled fp8 weights (the published DeepSeek-V3 / R1 and Qwen3 "-FP8" checkpoints) dequantized at load.

Such a checkpoint's config.json holds ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [bo, bi], "activation_scheme": "dynamic"}``, and each quantized linear layer's
``X.weight [out, in]`` is stored as float8_e4m3fn codes q beside ``X.weight_scale_inv`` float32
``[ceil(out / bo), ceil(in / bi)]``, one multiplier per ``bo x bi`` block (named for the inverse of the scale that
quantized it):

    W[o, i] = q[o, i] * scale_inv[o // bo, i // bi]

``dequantize_checkpoint`` replaces every such pair by W in float32, so the models read one layout; the engine then
serves it in its dtype like any checkpoint. (``python -m serving quantize --kind fp8`` quantizes it again, per
output column, for the 1-byte expert kernels.) Layers the checkpoint keeps unquantized (embeddings, norms, the
router, the output head) have no ``weight_scale_inv`` and pass through.
"""

import math

import ml_dtypes
import numpy as np

from serving.config import FP8_BLOCKS_METHOD

SCALE_SUFFIX = "_scale_inv"  # X.weight's multipliers: X.weight_scale_inv


def block_size(quantization_config: dict) -> tuple[int, int]:
    """``(bo, bi)`` of a ``quant_method: fp8`` config; anything but e4m3 codes in 2-D blocks -> ValueError."""
    block = quantization_config.get("weight_block_size")
    fmt = quantization_config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"config.json quantization_config.fmt = {fmt!r}: only e4m3 fp8 weights load")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"config.json quantization_config.weight_block_size = {block!r}: expected [rows, columns] "
                         "of each weight's scale blocks (per-tensor fp8 does not load; dequantize it first)")
    return block[0], block[1]


def dequantize_fp8_blocks(codes: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """``codes [out, in]`` float8_e4m3fn times their blocks' ``scale_inv [ceil(out / bo), ceil(in / bi)]`` ->
    float32 ``[out, in]`` (module docstring). Wrong dtypes or shapes -> ValueError naming them."""
    if codes.dtype != ml_dtypes.float8_e4m3fn or codes.ndim != 2:
        raise ValueError(f"fp8 block weights must be float8_e4m3fn [out, in], got {codes.dtype}{list(codes.shape)}")
    grid = tuple(math.ceil(n / b) for n, b in zip(codes.shape, block, strict=True))
    if scale_inv.shape != grid or scale_inv.dtype != np.float32:
        raise ValueError(f"fp8 block scales of a {list(codes.shape)} weight in {list(block)} blocks must be "
                         f"float32{list(grid)}, got {scale_inv.dtype}{list(scale_inv.shape)}")
    scales = np.repeat(np.repeat(scale_inv, block[0], axis=0), block[1], axis=1)[:codes.shape[0], :codes.shape[1]]
    return codes.astype(np.float32) * scales


def dequantize_checkpoint(tensors: dict[str, np.ndarray], quantization_config: dict | None) -> dict[str, np.ndarray]:
    """``tensors`` with each ``X.weight`` / ``X.weight_scale_inv`` pair replaced by ``X.weight`` dequantized
    (float32). A checkpoint without scale tensors comes back as it is; scales without a ``quant_method: fp8``
    config naming the block size, or a scale without its weight -> ValueError naming it."""
    scaled = [n.removesuffix(SCALE_SUFFIX) for n in tensors if n.endswith(SCALE_SUFFIX)]
    if not scaled:
        return tensors
    method = (quantization_config or {}).get("quant_method")
    if method != FP8_BLOCKS_METHOD:
        raise ValueError(f"checkpoint has {scaled[0]}{SCALE_SUFFIX} but config.json quantization_config.quant_method "
                         f"is {method!r}: expected {FP8_BLOCKS_METHOD!r} with weight_block_size")
    block = block_size(quantization_config)
    out = dict(tensors)
    for name in scaled:
        if name not in out:
            raise ValueError(f"checkpoint has {name}{SCALE_SUFFIX} but no {name}")
        out[name] = dequantize_fp8_blocks(out[name], out.pop(name + SCALE_SUFFIX), block)
    return out
