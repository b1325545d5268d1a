"""Checkpoint readers: HF safetensors folders (``safetensors.py``), GGUF files (``gguf.py``), this repository's
quantized folders (``quantized.py``); ``model.py`` turns a folder into a model's params."""

from serving.loaders.model import load_model
from serving.loaders.safetensors import read_checkpoint

__all__ = ["load_model", "read_checkpoint"]
