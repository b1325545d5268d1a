"""Tests for apex_jax.checkpoint: exact round trip, mismatch errors, manifests, crashes, SIGTERM."""

import logging
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import REPO

from apex_jax.checkpoint import MANIFEST, Checkpointer

SUBPROCESS_TIMEOUT_S = 120  # a child imports jax + orbax (a few seconds on 2 cores); generous for loaded CI


class Inner(NamedTuple):
    scale: jax.Array
    unused: Any  # None leaf: must survive the round trip


class State(NamedTuple):
    params: dict
    inner: Inner
    pair: tuple
    count: jax.Array


def _random_bits(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Arbitrary bit patterns (NaN payloads, denormals included): only a bit-exact store keeps them."""
    dtype = np.dtype(dtype)
    raw = rng.integers(0, 256, size=(*shape, dtype.itemsize), dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def make_state(seed: int = 0) -> State:
    rng = np.random.default_rng(seed)
    return State(
        params={"w": jnp.asarray(_random_bits(rng, (4, 3), np.float32)),
                "b": jnp.asarray(_random_bits(rng, (3,), jnp.bfloat16))},
        inner=Inner(scale=jnp.asarray(_random_bits(rng, (5,), np.int8)), unused=None),
        pair=(jnp.asarray(_random_bits(rng, (2, 2), np.uint8)), np.arange(3, dtype=np.uint8) + seed),
        count=jnp.int32(seed),
    )


def assert_bit_identical(actual: Any, expected: Any) -> None:
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a), np.asarray(e)
        assert (a.shape, a.dtype) == (e.shape, e.dtype)
        np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), e.reshape(-1).view(np.uint8))


def abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def test_round_trip_is_bit_exact_with_pytree_types(tmp_path):
    state = make_state(1)
    with Checkpointer(tmp_path, handle_sigterm=False) as ckpt:
        assert ckpt.save(7, state)
        for target in (make_state(0), abstract(make_state(0))):
            restored = ckpt.restore(target)
            assert type(restored) is State and type(restored.inner) is Inner
            assert restored.inner.unused is None and type(restored.pair) is tuple
            assert_bit_identical(restored, state)
        assert ckpt.latest_step() == 7


def test_optax_state_round_trip(tmp_path):
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2, jnp.bfloat16)}
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    opt_state = optimizer.init(params)
    _, opt_state = optimizer.update(params, opt_state, params)  # non-zero moments and count
    with Checkpointer(tmp_path, handle_sigterm=False) as ckpt:
        ckpt.save(1, (params, opt_state))
        restored = ckpt.restore(abstract((params, optimizer.init(params))))
    assert_bit_identical(restored, (params, opt_state))


@pytest.mark.parametrize("change, message", [
    (lambda s: s._replace(count=s.count.astype(jnp.float32)), "count: saved () int32, target () float32"),
    (lambda s: s._replace(params={**s.params, "w": jnp.zeros((3, 4))}),
     "params.w: saved (4, 3) float32, target (3, 4) float32"),
    (lambda s: s._replace(pair=s.pair[:1]), "pair.1: saved (3,) uint8, target missing"),
    (lambda s: s._replace(inner=s.inner._replace(unused=jnp.zeros(2))),
     "inner.unused: saved missing, target (2,) float32"),
], ids=["dtype", "shape", "leaf_missing_from_target", "leaf_missing_from_checkpoint"])
def test_restore_into_mismatched_target_names_the_leaf(tmp_path, change, message):
    with Checkpointer(tmp_path, handle_sigterm=False) as ckpt:
        ckpt.save(0, make_state())
        with pytest.raises(ValueError, match="does not match the target") as info:
            ckpt.restore(change(make_state()))
    assert message in str(info.value)


def test_save_interval_force_and_max_to_keep(tmp_path):
    with Checkpointer(tmp_path, max_to_keep=2, save_interval_steps=3, handle_sigterm=False) as ckpt:
        saved = [step for step in range(1, 11) if ckpt.save(step, make_state(step))]
        assert saved == [3, 6, 9]
        assert ckpt.save(10, make_state(10), force=True)
        assert not ckpt.save(10, make_state(10), force=True)  # already saved and verified
        assert ckpt.all_steps() == [9, 10]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["10", "9"]
        assert_bit_identical(ckpt.restore(make_state(), step=9), make_state(9))


def _flip_byte_in_largest_data_file(step_dir: pathlib.Path) -> None:
    data = max(step_dir.glob("default/ocdbt.process_0/d/*"), key=lambda p: p.stat().st_size)  # array chunks
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(raw)


def _save_two_and_damage_the_second(ckpt: Checkpointer, damage: str) -> None:
    ckpt.save(1, make_state(1))
    ckpt.save(2, make_state(2))
    if damage == "flip_byte":
        _flip_byte_in_largest_data_file(ckpt.directory / "2")
    else:
        (ckpt.directory / "2" / MANIFEST).unlink()


@pytest.mark.parametrize("damage", ["flip_byte", "delete_manifest"])
def test_damaged_latest_step_falls_back_to_previous(tmp_path, caplog, damage):
    with Checkpointer(tmp_path, handle_sigterm=False) as ckpt:
        _save_two_and_damage_the_second(ckpt, damage)
        with caplog.at_level(logging.WARNING, logger="apex_jax.checkpoint"):
            assert ckpt.latest_step() == 1
            assert_bit_identical(ckpt.restore(make_state()), make_state(1))
        assert "skipping checkpoint step 2" in caplog.text
        assert ckpt.all_steps() == [1, 2]
        with pytest.raises(ValueError, match="step 2 .* failed verification"):
            ckpt.restore(make_state(), step=2)
        assert ckpt.save(2, make_state(2))  # a damaged step is replaced, not kept
        assert_bit_identical(ckpt.restore(make_state()), make_state(2))


@pytest.mark.parametrize("damage", ["flip_byte", "delete_manifest"])
def test_retention_keeps_max_to_keep_verified_steps(tmp_path, caplog, damage):
    with Checkpointer(tmp_path, max_to_keep=2, handle_sigterm=False) as ckpt:
        _save_two_and_damage_the_second(ckpt, damage)
        with caplog.at_level(logging.WARNING, logger="apex_jax.checkpoint"):
            assert ckpt.save(3, make_state(3))
        assert "deleting unverified checkpoint step 2" in caplog.text
        assert ckpt.all_steps() == [1, 3]  # step 1, not the damaged step 2, is the fallback kept
        assert_bit_identical(ckpt.restore(make_state(), step=1), make_state(1))
        ckpt.save(4, make_state(4))
        assert ckpt.all_steps() == [3, 4]


def test_restore_without_checkpoint_raises(tmp_path):
    with Checkpointer(tmp_path, handle_sigterm=False) as ckpt:
        with pytest.raises(FileNotFoundError, match="no verified checkpoint"):
            ckpt.restore(make_state())
        ckpt.save(1, make_state(1))
        with pytest.raises(FileNotFoundError, match="no checkpoint step 5"):
            ckpt.restore(make_state(), step=5)


def _run_child(tmp_path: pathlib.Path, script: str, *args: str) -> subprocess.Popen:
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(script))
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen([sys.executable, str(path), *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_for_line(child: subprocess.Popen, prefix: str) -> str:
    for line in child.stdout:
        if line.startswith(prefix):
            return line
    raise AssertionError(f"child exited with {child.wait()} before printing {prefix!r}")


CRASH_SCRIPT = """
    import os, signal, sys, time
    import numpy as np
    from apex_jax.checkpoint import MANIFEST, Checkpointer

    directory, mode, max_to_keep = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ckpt = Checkpointer(directory, max_to_keep=max_to_keep, handle_sigterm=False)
    ckpt.save(1, {"x": np.arange(1000, dtype=np.float32), "n": np.int32(1)})
    new_step = 2
    if mode == "corrupt_latest":  # step 2 saved, then its manifest lost: step 1 is the only good one
        ckpt.save(2, {"x": np.ones(3, np.float32)})
        os.remove(os.path.join(directory, "2", MANIFEST))
        new_step = 3
    print("saved 1", flush=True)
    real_rename = os.rename
    def held_rename(src, dst, *args, **kwargs):  # hold orbax's finalize rename: the kill lands before it
        if os.path.basename(os.fspath(dst)) == str(new_step):
            time.sleep(600)
        return real_rename(src, dst, *args, **kwargs)
    if mode == "mid_write":
        os.rename = held_rename
    else:  # finalized by orbax, killed before the manifest is written
        Checkpointer._write_manifest = lambda self, step, tree: os.kill(os.getpid(), signal.SIGKILL)
    rng = np.random.default_rng(0)  # random: incompressible, so 32 MiB of chunks really hit the disk
    big = {f"leaf{i}": rng.standard_normal(1 << 20, np.float32) for i in range(8)}
    ckpt.save(new_step, big)
    print("finished", flush=True)
"""


@pytest.mark.parametrize("mode, max_to_keep, steps_after_kill", [
    ("mid_write", 3, [1]),
    ("mid_write", 1, [1]),
    ("before_manifest", 3, [1, 2]),
    ("before_manifest", 1, [1, 2]),  # orbax's own retention deleted step 1 here, before the manifest
    ("corrupt_latest", 2, [1, 2, 3]),  # and here, counting the unverified step 2 as one to keep
], ids=["mid_write", "mid_write_keep1", "before_manifest", "before_manifest_keep1", "corrupt_latest_keep2"])
def test_killed_save_leaves_previous_step_restorable(tmp_path, mode, max_to_keep, steps_after_kill):
    directory = tmp_path / "ckpt"
    child = _run_child(tmp_path, CRASH_SCRIPT, str(directory), mode, str(max_to_keep))
    try:
        _wait_for_line(child, "saved 1")
        if mode == "mid_write":
            deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
            while not any(p.is_file() for p in directory.glob("2.orbax-checkpoint-tmp/**/d/*")):
                assert time.monotonic() < deadline and child.poll() is None, "no step 2 data file appeared"
                time.sleep(0.001)
            child.send_signal(signal.SIGKILL)
            assert not (directory / "2").exists()
        assert child.wait(SUBPROCESS_TIMEOUT_S) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()

    with Checkpointer(directory, max_to_keep=max_to_keep, handle_sigterm=False) as ckpt:
        assert ckpt.all_steps() == steps_after_kill
        assert ckpt.latest_step() == 1
        restored = ckpt.restore({"x": np.zeros(1000, np.float32), "n": np.int32(0)})
        assert_bit_identical(restored, {"x": np.arange(1000, dtype=np.float32), "n": np.int32(1)})
        assert ckpt.save(2, {"x": np.ones(3, np.float32)})  # the step can be written again after the crash
        assert ckpt.latest_step() == 2
    # no tmp dir left behind; the unverified step 3 is deleted, step 1 kept while max_to_keep allows
    assert sorted(p.name for p in directory.iterdir()) == (["1", "2"] if max_to_keep > 1 else ["2"])


SIGTERM_LOOP_SCRIPT = """
    import sys, time
    import jax.numpy as jnp
    from apex_jax.checkpoint import Checkpointer

    with Checkpointer(sys.argv[1], save_interval_steps=1000) as ckpt:
        state = {"w": jnp.zeros(4), "step": jnp.int32(0)}
        print("ready", flush=True)
        for step in range(1, 10**9):
            state = {"w": state["w"] + 1, "step": jnp.int32(step)}
            time.sleep(0.001)
            if ckpt.save(step, state):
                print(f"saved {step}", flush=True)
            if ckpt.sigterm_received:
                break
    print("exiting", flush=True)
"""


def test_sigterm_saves_current_step_and_exits_cleanly(tmp_path):
    directory = tmp_path / "ckpt"
    child = _run_child(tmp_path, SIGTERM_LOOP_SCRIPT, str(directory))
    try:
        _wait_for_line(child, "ready")
        time.sleep(0.2)
        child.send_signal(signal.SIGTERM)
        step = int(_wait_for_line(child, "saved ").split()[1])
        child.wait(timeout=SUBPROCESS_TIMEOUT_S)
        # read() through the same buffered stream: communicate() would read the pipe's fd directly and miss lines
        # the iteration above had already buffered (e.g. "exiting" arriving in one chunk with "saved N").
        rest = child.stdout.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, rest
    assert "exiting" in rest and 0 < step < 1000
    with Checkpointer(directory, handle_sigterm=False) as ckpt:
        assert ckpt.latest_step() == step
        restored = ckpt.restore({"w": jnp.zeros(4), "step": jnp.int32(0)})
    np.testing.assert_array_equal(restored["w"], np.full(4, step, np.float32))
    assert int(restored["step"]) == step


def test_sigterm_handler_chains_and_is_restored_on_close(tmp_path):
    calls = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        ckpt = Checkpointer(tmp_path, save_interval_steps=100)
        assert not ckpt.sigterm_received
        signal.raise_signal(signal.SIGTERM)
        assert ckpt.sigterm_received and calls == [signal.SIGTERM]
        assert ckpt.save(3, make_state(3))  # off-interval step saved because of SIGTERM
        ckpt.close()
        assert signal.getsignal(signal.SIGTERM) not in (ckpt._on_sigterm, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
        assert calls == [signal.SIGTERM] * 2
    finally:
        signal.signal(signal.SIGTERM, previous)
