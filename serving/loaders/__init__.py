"""Checkpoint readers: HF safetensors folders (``safetensors.py``); each yields HF-named tensors."""

from serving.loaders.safetensors import load_model, read_checkpoint

__all__ = ["load_model", "read_checkpoint"]
