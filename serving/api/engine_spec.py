"""``EngineSpec``: everything needed to build the served ``Engine``, as plain data (str, int, bool, None).

The server's front end never builds the engine itself: it hands the spec to the engine core process
(``engine_core.py``), which calls ``build`` there, so the front end never loads weights nor touches a device.
``as_dict`` / ``from_dict`` are the spec on the wire (a dict of scalars).

``model``: ``DEFAULT_MODEL`` (the embedded SmolLM2-135M-Instruct), a HF folder or a .gguf file; with
``random_weights`` a HF ``config.json`` (or its folder) whose shape is served with the family's ``init_params``
(seed ``RANDOM_WEIGHTS_SEED``), with the ``tokenizer.json`` beside it when there is one. ``quantize`` ("int8" or
"fp8"): the loaded weights quantized per output column before serving (``quantization.quantize_params``, as
``python -m serving quantize`` writes them; the expert matmuls then read 1-byte codes). ``data_parallel x
tensor_parallel x expert_parallel`` is the mesh over every device of the process that builds the engine
(all 1: one device).
"""

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from serving import sharding
from serving.config import ModelConfig
from serving.images import PROCESSOR_FILE
from serving.json_files import read_json
from serving.llm_engine import DTYPES as ENGINE_DTYPES
from serving.llm_engine import Engine, resolve_dtype
from serving.loaders.model import LoadedModel, eos_from_folder, image_processor_from_folder, load_model
from serving.models import model_module
from serving.quantization import KINDS as QUANTIZED_KINDS
from serving.quantization import is_quantized, quantize_params
from serving.spec_decode import SpecConfig
from serving.tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2"  # the embedded SmolLM2-135M-Instruct
DTYPES = ("auto", *ENGINE_DTYPES)  # names Engine takes (serving.llm_engine.resolve_dtype)
RANDOM_WEIGHTS_SEED = 0  # random weights: the same on every run, so runs compare


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """The arguments of ``Engine`` (see its docstring) as plain data, plus where the weights come from."""

    model: str = DEFAULT_MODEL
    random_weights: bool = False
    dtype: str = "auto"
    num_blocks: int = 1024
    block_size: int = 16
    max_running: int = 32
    max_queue: int | None = 64
    token_budget: int = 512
    max_model_len: int | None = None
    batch_invariant: bool = False
    decode_steps: int | None = None  # None: by backend (serving.llm_engine.DECODE_STEPS)
    speculative: str | None = None  # a method of serving.spec_decode.SPECULATIVE_METHODS
    drafter: str | None = None  # the block drafter's checkpoint
    num_speculative_tokens: int | None = None
    static_speculation: bool = False  # draft k tokens every step (False: the adaptive policy chooses, or none)
    data_parallel: int = 1
    tensor_parallel: int = 1
    expert_parallel: int = 1
    prefill_chunk: int | None = None  # None: half the token budget
    compilation_cache: str | bool = True  # a folder, True (the project's cache folder) or False (off)
    host_cache_gb: float = 0.0  # the prefix cache's host-memory tier (0: none; serving.engine.kv_tiers)
    disk_cache: str | None = None  # the disk tier's folder under the host tier (None: none)
    persist_disk_cache: bool = False  # at stop, copy the GPU's cached blocks to the disk tier too
    admission_window: float = 0.0  # the core's AdmissionWindow fraction (0: off; engine_core.py, not an Engine's)
    quantize: str | None = None  # "int8" | "fp8": quantize the loaded weights per output column (None: as loaded)
    eager_admission: bool = False  # Engine(eager_admission=...): a short decode after a finish while a slot is free

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineSpec.dtype = {self.dtype!r}: expected one of {list(DTYPES)}")
        if (self.disk_cache is not None or self.persist_disk_cache) and self.host_cache_gb <= 0:
            raise ValueError(f"--disk-cache {self.disk_cache!r} / --persist-disk-cache need --host-cache-gb > 0 (the "
                             f"disk tier sits under the host tier), got {self.host_cache_gb}")
        if self.persist_disk_cache and self.disk_cache is None:
            raise ValueError("--persist-disk-cache needs --disk-cache DIR")
        if self.quantize is not None and self.quantize not in QUANTIZED_KINDS:
            raise ValueError(f"--quantize {self.quantize!r}: expected one of {list(QUANTIZED_KINDS)}")
        if self.quantize is not None and self.batch_invariant:
            raise ValueError(f"--quantize {self.quantize} with --batch-invariant: that mode runs plain bf16/fp32 "
                             "weights only")
        if not 0 <= self.admission_window < 1:
            raise ValueError(f"--admission-window {self.admission_window}: expected a fraction in [0, 1) (0: off)")
        if self.speculative is None and (self.drafter or self.num_speculative_tokens or self.static_speculation):
            raise ValueError("--drafter, --num-speculative-tokens and --static-speculation need --speculative "
                             "(ngram, suffix or block)")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "EngineSpec":
        unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"EngineSpec: unknown fields {sorted(unknown)}")
        return cls(**fields)

    def served_name(self) -> tuple[str, Path | None]:
        """(the model's default served name, its path or None for the embedded model), checking the path and that
        a HF folder's config.json describes a model the engine serves (``ModelConfig.from_hf``: a ValueError
        naming the config key it cannot honour), before any weight is read."""
        if self.random_weights:
            config = _config_file(self.model)
            _check_config(config)
            return config.parent.resolve().name, config.parent
        if self.model == DEFAULT_MODEL:
            return DEFAULT_MODEL, None
        path = Path(self.model)
        if not path.exists():
            raise FileNotFoundError(f"--model {self.model!r}: expected {DEFAULT_MODEL!r}, a HF folder or a .gguf file")
        if path.suffix == ".json":
            raise ValueError(f"--model {self.model!r} is a config without weights: add --random-weights to serve it "
                             "with random weights, or pass a HF folder or a .gguf file")
        if (path / "config.json").is_file():
            _check_config(path / "config.json")
        return path.name, path

    def build(self) -> Engine:
        """The ``Engine`` this spec describes (loads the weights and allocates the cache on this process's
        devices)."""
        options = dict(dtype=self.dtype, num_blocks=self.num_blocks, block_size=self.block_size,
                       max_running=self.max_running, token_budget=self.token_budget,
                       max_model_len=self.max_model_len, max_queue=self.max_queue,
                       batch_invariant=self.batch_invariant, mesh=self._mesh(), decode_steps=self.decode_steps,
                       prefill_chunk=self.prefill_chunk, compilation_cache=self.compilation_cache,
                       eager_admission=self.eager_admission,
                       host_cache_gb=self.host_cache_gb or None, disk_cache_dir=self.disk_cache,
                       speculative=SpecConfig.from_method(self.speculative, self.drafter, self.num_speculative_tokens,
                                                          adaptive=not self.static_speculation)
                       if self.speculative else None)
        _, path = self.served_name()
        if self.random_weights:
            config = _config_file(self.model)
            loaded = _load_random(config, resolve_dtype(self.dtype, config.parent))
        elif self.quantize is None:
            return Engine(path, **options)
        else:
            loaded = load_model(path, resolve_dtype(self.dtype, path))
        if self.quantize is not None:
            if any(is_quantized(leaf) for leaf in jax.tree.leaves(loaded.params, is_leaf=is_quantized)):
                raise ValueError(f"--quantize {self.quantize}: --model {self.model!r} is quantized already")
            loaded = loaded._replace(params=quantize_params(loaded.params, self.quantize, loaded.cfg))
        return Engine(loaded, **options)

    def _mesh(self) -> Mesh | None:
        """The ``data x tensor x expert`` mesh over every device, or None (one device) when all three are 1."""
        sizes = {"--data-parallel": self.data_parallel, "--tensor-parallel": self.tensor_parallel,
                 "--expert-parallel": self.expert_parallel}
        named = " x ".join(f"{flag} {n}" for flag, n in sizes.items())
        if min(sizes.values()) < 1:
            raise ValueError(f"{named}: expected sizes >= 1")
        devices = math.prod(sizes.values())
        if devices == 1:
            return None
        if devices != jax.device_count():
            raise ValueError(f"{named} = {devices} devices: expected their product to be the {jax.device_count()} "
                             f"{jax.default_backend()} devices this process sees (CUDA_VISIBLE_DEVICES picks the "
                             "GPUs)")
        return sharding.make_mesh(*sizes.values())


def _config_file(model: str) -> Path:
    """The HF config.json that ``model`` names for random weights (the file, or the folder holding it)."""
    if model == DEFAULT_MODEL:
        raise ValueError(f"--random-weights with --model {model!r}: expected a HF config.json or its folder")
    path = Path(model)
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file() or config.suffix != ".json":
        raise FileNotFoundError(f"--random-weights --model {model!r}: expected a HF config.json file or a folder "
                                "holding one")
    return config


def _check_config(config: Path) -> None:
    """``ModelConfig.from_hf`` of the file ``config``, its ValueError prefixed with the file."""
    try:
        ModelConfig.from_hf(read_json(config))
    except ValueError as e:
        raise ValueError(f"--model {str(config.parent)!r}: {e}") from None


def _load_random(config: Path, dtype: jnp.dtype) -> LoadedModel:
    """Random weights of the model ``config`` describes, with the tokenizer beside it if any."""
    cfg = ModelConfig.from_hf(read_json(config))
    params = model_module(cfg.family).init_params(cfg, jax.random.key(RANDOM_WEIGHTS_SEED), dtype)
    folder = config.parent
    tokenizer = Tokenizer.from_hf_folder(folder) if (folder / "tokenizer.json").is_file() else None
    return LoadedModel(cfg, params, tokenizer, tokenizer.eos_token_ids if tokenizer else eos_from_folder(folder),
                       image_processor_from_folder(cfg, folder) if (folder / PROCESSOR_FILE).is_file() else None)
