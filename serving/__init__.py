"""MoE LLM inference: models, loaders, the paged-KV engine and the OpenAI/Anthropic-compatible server.

    import serving

    serving.enable_command_buffers()  # on a GPU, before jax starts its backend
    engine = serving.Engine(serving.load_model("path/to/model"))
    [result] = engine.generate(["Hello"], serving.SamplingParams(max_tokens=16))

The names below are imported on first use, so ``import serving`` loads no jax and changes nothing in the process.
"""

import importlib
import os
from typing import TYPE_CHECKING

COMMAND_BUFFER_FLAGS = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN "
                        "--xla_gpu_graph_min_graph_size=1")

# public name -> the module that defines it
_EXPORTS = {
    "ConstraintSpec": "serving.structured",
    "DecodeSteps": "serving.llm_engine",
    "Engine": "serving.llm_engine",
    "LoadedModel": "serving.loaders.model",
    "SamplingParams": "serving.engine.sampling_params",
    "SpecConfig": "serving.spec_decode.config",
    "load_model": "serving.loaders.model",
}

__all__ = ["COMMAND_BUFFER_FLAGS", "ConstraintSpec", "DecodeSteps", "Engine", "LoadedModel", "SamplingParams",
           "SpecConfig", "enable_command_buffers", "load_model"]

if TYPE_CHECKING:
    from serving.engine.sampling_params import SamplingParams
    from serving.llm_engine import DecodeSteps, Engine
    from serving.loaders.model import LoadedModel, load_model
    from serving.spec_decode.config import SpecConfig
    from serving.structured import ConstraintSpec


def enable_command_buffers() -> None:
    """Ask XLA to record every kernel of a jitted step into CUDA graphs (command buffers), the Pallas/Triton custom
    calls included, by adding ``COMMAND_BUFFER_FLAGS`` to ``XLA_FLAGS``, unless ``XLA_FLAGS`` already sets
    ``xla_gpu_enable_command_buffer`` (the caller's choice wins).

    A decode step launches ~80 small kernels per layer, and replaying them as one graph removes the launch gaps
    between them. XLA reads the flags when jax starts its GPU backend: call this before the first computation or
    device query (``python -m serving`` and the serving benchmarks call it first thing); later, it has no effect.
    """
    if "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {COMMAND_BUFFER_FLAGS}".strip()


def __getattr__(name: str):
    """The public names of ``_EXPORTS``, imported from their module on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'serving' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
