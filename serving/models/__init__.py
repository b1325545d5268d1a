"""Model families: ``model_module(family)`` is the one place a family name picks its implementation.

Every module has ``init_params(cfg, key, dtype)``, ``params_from_hf(cfg, tensors, dtype)``,
``param_specs(cfg)`` and ``forward(params, cfg, tokens, batch, kv, kernels=..., rows=None) -> (logits, kv,
expert_counts)``: the logits at the flat indices ``rows`` (None: at every token).
"""

import importlib
from types import ModuleType

FAMILY_MODULES = {
    "llama": "serving.models.llama",
    "qwen3": "serving.models.llama",  # Llama with per-head q/k RMSNorm (cfg.qk_norm)
    "qwen3_moe": "serving.models.moe",
    "mixtral": "serving.models.moe",
    "deepseek_v3": "serving.models.deepseek",
    "gpt_oss": "serving.models.gpt_oss",
    "qwen3_vl_moe": "serving.models.qwen3_vl_moe",  # + ``encode_images`` and ``forward(..., mm)``
}


def model_module(family: str) -> ModuleType:
    """The module implementing ``family`` (a ``ModelConfig.family``)."""
    if family not in FAMILY_MODULES:
        raise ValueError(f"unknown model family {family!r}: expected one of {list(FAMILY_MODULES)}")
    return importlib.import_module(FAMILY_MODULES[family])
