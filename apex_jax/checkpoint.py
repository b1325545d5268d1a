"""Crash-safe training checkpoints on orbax, with a sha256 manifest per step and SIGTERM handling.

Layout on disk (one process writes the directory; local filesystem)::

    directory/
      <step>/                          one finalized orbax step (``ocp.CheckpointManager``)
        _CHECKPOINT_METADATA
        default/                       the pytree (``ocp.args.StandardSave``), OCDBT + tensorstore files
        manifest.json                  {"step": N, "sha256": {relative path: hex digest}} of every other file
      <step>.orbax-checkpoint-tmp/     a save in progress or killed; never read, removed on the next open

Orbax writes a step into the tmp dir and renames it on finalize, so a killed save leaves earlier steps
intact. The manifest is written (tmp file + fsync + ``os.replace``) only after the step is finalized and
every file is fsynced; a step without a valid manifest is skipped by ``latest_step``/``restore``.
Retention runs only after that: it keeps the new step and the newest ``max_to_keep - 1`` other steps that
verify and deletes the rest, so a save killed at any point, or a corrupt step, never costs the last good one.

Example::

    with Checkpointer(ckpt_dir, save_interval_steps=100) as ckpt:
        start = ckpt.latest_step()
        state, start = (state, 0) if start is None else (ckpt.restore(state, start), start + 1)
        for step in range(start, num_steps):
            state = train_step(state)
            ckpt.save(step, state)
            if ckpt.sigterm_received:
                break
"""

import hashlib
import json
import logging
import os
import pathlib
import signal
import threading
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from apex_jax.flat import FlatParams

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_HASH_CHUNK = 1 << 20  # read files in 1 MiB pieces: bounded memory for multi-GB checkpoints


def _leaf_path(path: tuple) -> str:
    """'opt.1.mu.w' for any key type (NamedTuple fields, dict keys, sequence indices), as orbax names it."""
    return ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)


def _leaf_spec(x: Any) -> tuple[tuple[int, ...], np.dtype]:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return tuple(x.shape), np.dtype(x.dtype)
    x = np.asarray(x)  # Python scalars
    return x.shape, x.dtype


def _abstract_leaf(x: Any) -> Any:
    """What orbax restores into: arrays become ShapeDtypeStruct (keeping a jax.Array's sharding)."""
    if isinstance(x, np.generic):  # to_shape_dtype_struct passes numpy scalars through; restore rejects them
        x = np.asarray(x)
    return ocp.utils.to_shape_dtype_struct(x)


def _describe(spec: tuple[tuple[int, ...], np.dtype] | None) -> str:
    return "missing" if spec is None else f"{spec[0]} {spec[1]}"


def _flat_layouts(tree: Any) -> list[str]:
    """sha256 of each FlatParams layout in tree: orbax saves the buffers, not the static layout."""
    nodes = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, FlatParams))
    return [hashlib.sha256(repr(n.layout.key).encode()).hexdigest() for n in nodes if isinstance(n, FlatParams)]


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_files(step_dir: pathlib.Path, fsync: bool = False) -> dict[str, str]:
    """sha256 of every file under step_dir except the manifest; with fsync, also flush each file and dir."""
    digests = {}
    for root, _, files in os.walk(step_dir):
        for name in files:
            path = pathlib.Path(root, name)
            rel = path.relative_to(step_dir).as_posix()
            if rel == MANIFEST:
                continue
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(_HASH_CHUNK):
                    digest.update(chunk)
                if fsync:
                    os.fsync(f.fileno())
            digests[rel] = digest.hexdigest()
        if fsync:
            _fsync_dir(pathlib.Path(root))
    return dict(sorted(digests.items()))


class Checkpointer:
    """Saves and restores one pytree per step; the one checkpoint entry point of every training loop.

    Args:
      directory: root folder (created if missing).
      max_to_keep: verified steps kept on disk (the newest; others and unverified steps are deleted after
        each save, which re-hashes up to ``max_to_keep - 1`` older steps); None keeps every step.
      save_interval_steps: ``save`` writes when ``step % save_interval_steps == 0``.
      handle_sigterm: install a SIGTERM handler so the next ``save`` writes regardless of interval.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
                 save_interval_steps: int = 1, handle_sigterm: bool = True):
        if save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be >= 1, got {save_interval_steps}")
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
        self.directory = pathlib.Path(directory).absolute()
        self.save_interval_steps = save_interval_steps
        self.max_to_keep = max_to_keep
        # No orbax retention: it deletes old steps on finalize, before this step's manifest exists.
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(
            self.directory, item_handlers=ocp.StandardCheckpointHandler(), options=options)
        self._sigterm = False
        self._previous_handler = None
        self._handling_sigterm = handle_sigterm
        if handle_sigterm:
            if threading.current_thread() is not threading.main_thread():
                raise ValueError("handle_sigterm=True needs the main thread; pass handle_sigterm=False")
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._sigterm = True
        if callable(self._previous_handler):  # SIG_DFL would kill us before the save: don't chain to it
            self._previous_handler(signum, frame)

    @property
    def sigterm_received(self) -> bool:
        """True once SIGTERM arrived: the loop should ``save`` and exit."""
        return self._sigterm

    def all_steps(self) -> list[int]:
        """Finalized steps on disk, ascending (manifests not checked)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def _manifest_error(self, step: int) -> str | None:
        """Why step fails verification, or None when its manifest matches its files."""
        step_dir = self.directory / str(step)
        try:
            expected = dict(json.loads((step_dir / MANIFEST).read_text())["sha256"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"missing or unreadable {MANIFEST}: {e!r}"
        bad = set(expected.items()) ^ set(_hash_files(step_dir).items())
        return f"files differ from {MANIFEST}: {sorted({p for p, _ in bad})}" if bad else None

    def latest_step(self) -> int | None:
        """Newest step whose manifest verifies; logs a warning for each newer step skipped."""
        for step in reversed(self.all_steps()):
            if (error := self._manifest_error(step)) is None:
                return step
            logger.warning("skipping checkpoint step %d in %s: %s", step, self.directory, error)
        return None

    def _write_manifest(self, step: int, tree: Any) -> None:
        step_dir = self.directory / str(step)
        body = json.dumps({"step": step, "flat_layouts": _flat_layouts(tree),
                           "sha256": _hash_files(step_dir, fsync=True)}, indent=1)
        tmp = step_dir / (MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, step_dir / MANIFEST)
        _fsync_dir(step_dir)
        _fsync_dir(self.directory)

    def save(self, step: int, tree: Any, *, force: bool = False) -> bool:
        """Saves tree at step, blocking until durable, if step is on the interval, force, or SIGTERM came.

        Returns whether it saved (False also when this step is already saved and verifies).
        """
        if not (force or self._sigterm or step % self.save_interval_steps == 0):
            return False
        if step in self.all_steps():
            if (error := self._manifest_error(step)) is None:
                return False
            logger.warning("replacing unverified checkpoint step %d: %s", step, error)
            self._manager.delete(step)
        if self._sigterm:
            logger.warning("SIGTERM received: saving checkpoint step %d", step)
        self._manager.save(step, args=ocp.args.StandardSave(tree), force=True)
        self._manager.wait_until_finished()
        self._write_manifest(step, tree)
        self._apply_retention(step)
        return True

    def _apply_retention(self, saved: int) -> None:
        """Keeps step saved (manifest durable) and the newest max_to_keep - 1 other verified steps; deletes the rest."""
        if self.max_to_keep is None:
            return
        kept = 1
        for step in reversed(self.all_steps()):
            if step == saved:
                continue
            if kept < self.max_to_keep:
                if (error := self._manifest_error(step)) is None:
                    kept += 1
                    continue
                logger.warning("deleting unverified checkpoint step %d: %s", step, error)
            self._manager.delete(step)

    def _check_matches(self, step: int, target: Any) -> None:
        """Raises ValueError listing every leaf whose path, shape or dtype differs from the saved one."""
        saved = self._manager.item_metadata(step).tree
        saved = {_leaf_path(p): _leaf_spec(m) for p, m in jax.tree_util.tree_flatten_with_path(saved)[0]}
        wanted = {_leaf_path(p): _leaf_spec(x) for p, x in jax.tree_util.tree_flatten_with_path(target)[0]}
        problems = [f"{path}: saved {_describe(saved.get(path))}, target {_describe(wanted.get(path))}"
                    for path in sorted(saved.keys() | wanted.keys()) if saved.get(path) != wanted.get(path)]
        manifest = json.loads((self.directory / str(step) / MANIFEST).read_text())
        if manifest.get("flat_layouts", []) != _flat_layouts(target):
            problems.append("FlatParams layout: the target's leaf shapes, dtypes or order differ from the saved ones")
        if problems:
            raise ValueError(f"checkpoint step {step} in {self.directory} does not match the target:\n  "
                             + "\n  ".join(problems))

    def restore(self, target: Any, step: int | None = None) -> Any:
        """Restores the step (None: latest verified) into target's pytree types, shapes and dtypes.

        Args:
          target: pytree of arrays or ``jax.ShapeDtypeStruct`` (their sharding is used when set).
          step: which step; an explicit step must exist and verify.
        Returns:
          The saved tree, with target's exact pytree node types (NamedTuples, tuples, dicts).
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no verified checkpoint in {self.directory} "
                                        f"(finalized steps: {self.all_steps()})")
        elif step not in self.all_steps():
            raise FileNotFoundError(f"no checkpoint step {step} in {self.directory}; have {self.all_steps()}")
        elif (error := self._manifest_error(step)) is not None:
            raise ValueError(f"checkpoint step {step} in {self.directory} failed verification: {error}")
        self._check_matches(step, target)
        abstract = jax.tree.map(_abstract_leaf, target)
        return self._manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def close(self) -> None:
        """Waits for orbax and puts the previous SIGTERM handler back (if ours is still installed)."""
        self._manager.close()
        if self._handling_sigterm and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            previous = self._previous_handler
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
            self._handling_sigterm = False

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
