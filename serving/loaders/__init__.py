"""Checkpoints -> a model ready to serve: ``load_model`` (``model.py``) over the readers of HF safetensors folders
(``safetensors.py``), GGUF files (``gguf.py``) and this repository's quantized folders (``quantized.py``)."""

from serving.loaders.model import LoadedModel, load_model, load_params
from serving.loaders.safetensors import read_checkpoint

__all__ = ["LoadedModel", "load_model", "load_params", "read_checkpoint"]
