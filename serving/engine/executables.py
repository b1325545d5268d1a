"""The device calls a runner compiled before serving, by what they are for, and a folder of their exported modules.

Serving must meet no new shape: ``Engine.warm_up`` compiles every call a step can make and puts each in the runner's
``Executables`` under its ``key`` (the call's name, static arguments and operand shapes); the runner then calls the
compiled executable for a key it holds, and its jitted function (tracing and compiling) for any other.

A start with a warm persistent compilation cache still traces and lowers every call to find its cache key, and
that dominates such a start (a Mosaic GPU kernel's lowering is Python work, and each forward step holds several).
So, with a ``folder``, each call is kept as its ``jax.export`` serialization, named by a digest of its name, its
static arguments (the model config and kernel policy among them), its operands' shapes, the ``salt`` (the device)
and ``SOURCE_SALT`` (this package's and ``pallas_kernels``' source, jax's version): a later start deserializes it
and compiles ``jit(exported.call)``, a wrapper of the stored module whose lowering is cheap and byte-identical run
to run, so XLA's persistent cache finds it too. Anything that changes what the call computes changes the name; a
file that does not deserialize is replaced, and a call ``jax.export`` refuses is traced at every start, as without
a folder. The folder is trusted like the compilation cache it sits in (``jax.export.deserialize`` runs what it
reads), and nothing prunes it: files of older sources stay until the folder is cleared.
"""

import hashlib
import importlib.metadata
import json
import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import jax
from jax import export

import pallas_kernels
from serving.engine.sampler import SampleResult, SamplingBatch
from serving.kv_cache import AttentionBatch, PagedKV, PagedLatentKV
from serving.quantization import QuantizedWeight

# The Pallas kernels' custom calls carry their own module (Mosaic GPU) or Triton IR: our code, serialized with the
# source it came from (SOURCE_SALT), not a target whose compatibility jax.export can vouch for.
KERNEL_CALLS = ("mosaic_gpu_v2", "__gpu$xla.gpu.triton")
log = logging.getLogger(__name__)


def _source_salt() -> str:
    """A digest of every Python source of ``serving`` and ``pallas_kernels`` and of jax's and jaxlib's versions."""
    digest = hashlib.sha256(f"{jax.__version__} {importlib.metadata.version('jaxlib')}".encode())
    for root in (Path(__file__).resolve().parents[1], Path(pallas_kernels.__file__).resolve().parent):
        for path in sorted(root.rglob("*.py")):
            digest.update(f"{root.name}/{path.relative_to(root)}".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


SOURCE_SALT = _source_salt()
_lock = threading.Lock()
_registered: set[type] = set()


def _register_pytrees() -> None:
    """The pytree nodes the runner's calls take and return, serializable in an exported call's pytree: named tuples,
    and the quantized weights (their static ``k_major`` as JSON)."""
    with _lock:
        for cls in (AttentionBatch, PagedKV, PagedLatentKV, SampleResult, SamplingBatch):
            if cls not in _registered:
                export.register_namedtuple_serialization(cls, serialized_name=f"apex_jax.{cls.__name__}")
                _registered.add(cls)
        if QuantizedWeight not in _registered:
            export.register_pytree_node_serialization(
                QuantizedWeight, serialized_name="apex_jax.QuantizedWeight",
                serialize_auxdata=lambda aux: json.dumps(list(aux)).encode(),
                deserialize_auxdata=lambda data: tuple(json.loads(data)))
            _registered.add(QuantizedWeight)


def _stable(value: Any) -> str:
    """``value`` as text that is the same in every process (a function by its qualified name, not its address)."""
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{value.__module__}.{value.__qualname__}"
    return repr(value)


class Executables:
    """Compiled calls by key (module docstring). A key is the call's name, its static arguments and the pytree
    structure, shapes and dtypes of its varying arguments (those after the ``fixed`` ones: the params and cache,
    whose shapes never change). ``folder``: where exported calls are kept (None: nowhere, each traced and lowered
    every start); ``salt``: what else they depend on (the device)."""

    def __init__(self, folder: str | Path | None = None, salt: str = ""):
        self.folder = None if folder is None else Path(folder)
        self.salt = salt
        self.compiled: dict[Hashable, jax.stages.Compiled] = {}
        self.loaded = 0  # calls read back from the folder rather than traced

    @staticmethod
    def key(name: str, args: Sequence[Any], static: dict[str, Any]) -> tuple:
        leaves, structure = jax.tree.flatten(list(args))
        return (name, tuple(sorted(static.items())), structure,
                tuple((tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves))

    def call(self, name: str, jitted: Callable, fixed: Sequence[Any], args: Sequence[Any],
             static: dict[str, Any]) -> Any:
        """``jitted(*fixed, *args, **static)``, through the executable compiled for it when there is one."""
        compiled = self.compiled.get(self.key(name, args, static)) if self.compiled else None
        return jitted(*fixed, *args, **static) if compiled is None else compiled(*fixed, *args)

    def build(self, name: str, jitted: Callable, fixed: Sequence[Any], args: Sequence[Any], static: dict[str, Any],
              donate: tuple[int, ...] = ()) -> jax.stages.Compiled:
        """Compile ``jitted(*fixed, *args, **static)`` (arrays or ``jax.ShapeDtypeStruct``s; ``donate``: the
        positions ``jitted`` donates) and keep it for ``call``: from the folder's exported module when it holds
        one, else traced, lowered and (with a folder) exported there first."""
        key = self.key(name, args, static)
        exported = None
        if self.folder is not None:
            try:
                exported = self._exported(key, jitted, [*fixed, *args], static)
            except Exception as e:  # a call jax.export does not take: traced at every start, as without a folder
                log.warning("%s: not kept in %s (%s: %s); it is traced at every start", name, self.folder,
                            type(e).__name__, e)
        if exported is None:
            compiled = jitted.lower(*fixed, *args, **static).compile()
        else:
            compiled = jax.jit(exported.call, donate_argnums=donate).lower(*fixed, *args).compile()
        self.compiled[key] = compiled
        return compiled

    def _exported(self, key: tuple, jitted: Callable, args: list[Any], static: dict[str, Any]) -> export.Exported:
        _register_pytrees()
        name, static_items, *_ = key
        shapes = [(tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(args)]
        text = repr((SOURCE_SALT, self.salt, name, [(k, _stable(v)) for k, v in static_items],
                     str(jax.tree.structure(args)), shapes))
        path = self.folder / f"{hashlib.sha256(text.encode()).hexdigest()}.jax_exported"
        if path.is_file():
            try:
                exported = export.deserialize(bytearray(path.read_bytes()))
                self.loaded += 1
                return exported
            except Exception:  # cut short or unreadable: export it again
                path.unlink(missing_ok=True)
        exported = export.export(jitted, disabled_checks=[export.DisabledSafetyCheck.custom_call(c)
                                                          for c in KERNEL_CALLS])(*args, **static)
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{threading.get_ident()}.part")
        partial.write_bytes(exported.serialize())
        partial.replace(path)  # atomic: a reader sees a whole file or none
        return exported
