"""A short CPU tour of apex-jax: ``python -m examples.tour`` (or ``make demo``).

The tour is a list of steps (:data:`STEPS`), each a function of the shared :class:`Tour`, run in order:

1. ``train_optimizers``: an MLP 784-256-256-10 on real MNIST, one epoch per optimizer variant (optax.adamw
   with fp32 state; apexw with bf16 and int8 state through optax; the fused ``ApexW.step`` on the params pytree).
2. ``checkpoint_round_trip``: the fused variant's params and state saved with :class:`Checkpointer` and
   restored bit-exactly.
3. ``optimizer_table``: final train loss, test accuracy, optimizer-state memory and median step time.
4. ``predictive_coding_epoch``: one epoch of supervised predictive coding (``pc``) on MNIST, in Deepity's
   configuration (784-512-512-10 sigmoid, T=20 Euler settling steps, batch 250, AdamW), as one jitted call.

5. ``serving_chat``: the real SmolLM2-135M-Instruct served on 127.0.0.1 by ``serving``'s OpenAI-compatible
   server, one chat request through the official ``openai`` client, the reply and tokens/s.
6. ``summary``: one table of what each part showed and how long it took, against the tour's 5-minute budget.
"""

import dataclasses
import math
import tempfile
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from apex_data import MNIST_CLASSES, MNIST_PIXELS, Mnist, load_mnist
from apex_jax.checkpoint import Checkpointer
from apex_jax.transform import ApexW, ApexWState, apexw, state_nbytes
from pc import PCNet, evaluate, init_params, train_epoch

HIDDEN = (256, 256)  # MLP 784-256-256-10: 269k params, a few ms a step on 2 CPU cores
LOSS_WINDOW = 20  # the reported train loss is the mean of the last this many steps (one batch is noisy)
FUSED = "ApexW.step int8 (flat)"  # the variant whose model the checkpoint step saves
REFERENCE = "optax.adamw fp32"  # what the summary compares the fused variant with
BUDGET_S = 300  # the whole tour on 2 CPU cores, downloads of MNIST and SmolLM2 aside


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """What the tour trains: ``steps=None`` means one epoch of MNIST's 50k training images."""

    steps: int | None = None
    batch_size: int = 128
    learning_rate: float = 1e-3
    weight_decay: float = 1e-4
    seed: int = 0

    def __post_init__(self):
        if self.steps is not None and self.steps < 2:
            raise ValueError(f"steps must be >= 2 (the first step compiles and is not timed), got {self.steps}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")


class OptimizerRow(NamedTuple):
    """One line of the optimizer table."""

    variant: str
    losses: np.ndarray  # float32 [steps]: the training loss of every step
    test_accuracy: float
    state_bytes: int
    n_params: int
    step_ms: float  # median over all steps but the first (which compiles)

    @property
    def final_loss(self) -> float:
        return float(self.losses[-LOSS_WINDOW:].mean())

    @property
    def bytes_per_param(self) -> float:
        return self.state_bytes / self.n_params


@dataclasses.dataclass
class Tour:
    """What the steps share: the config, the console, and what earlier steps left for later ones."""

    config: DemoConfig
    console: Console
    mnist: Mnist | None = None
    optimizer_rows: list[OptimizerRow] = dataclasses.field(default_factory=list)
    results: dict[str, Any] = dataclasses.field(default_factory=dict)  # e.g. variant name -> (params, state)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # step function name -> wall time


class DemoStep(NamedTuple):
    name: str
    run: Callable[[Tour], None]


# ---------------------------------------------------------------------------------------------- the model


def init_mlp(key: jax.Array, sizes: tuple[int, ...] = (MNIST_PIXELS, *HIDDEN, MNIST_CLASSES)) -> dict:
    """He-normal weights ``w [fan_in, fan_out]`` and zero biases ``b [fan_out]``, one dict per layer."""
    keys = jax.random.split(key, len(sizes) - 1)
    return {f"layer{i}": {"w": jax.random.normal(k, (m, n)) * math.sqrt(2.0 / m), "b": jnp.zeros(n)}
            for i, (k, m, n) in enumerate(zip(keys, sizes[:-1], sizes[1:], strict=True))}


def mlp(params: dict, x: jax.Array) -> jax.Array:
    """Logits ``[batch, 10]`` of images ``x [batch, 784]``."""
    layers = list(params.values())
    for layer in layers[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ layers[-1]["w"] + layers[-1]["b"]


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(mlp(params, x), y).mean()


@jax.jit
def accuracy(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.argmax(mlp(params, x), axis=-1) == y)


# ---------------------------------------------------------------------------------------------- variants


class Variant(NamedTuple):
    """An optimizer to train with: ``init(params) -> (carry, state)`` and a jitted, donating step."""

    name: str
    init: Callable[[dict], tuple[Any, Any]]
    step: Callable  # (carry, state, x, y) -> (carry, state, loss)
    tree: Callable[[Any], dict]  # carry -> params pytree


def optax_variant(name: str, tx: optax.GradientTransformation) -> Variant:
    """Params as a pytree; gradients through ``tx.update`` and ``optax.apply_updates``."""

    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return Variant(name, lambda params: (params, tx.init(params)), jax.jit(step, donate_argnums=(0, 1)),
                   lambda params: params)


def fused_variant(name: str, opt: ApexW) -> Variant:
    """Params as a pytree, moments flat: one fused ``opt.step`` updates each leaf in place."""

    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        params, state = opt.step(params, grads, state)
        return params, state, loss

    return Variant(name, lambda params: (params, opt.init(params)), jax.jit(step, donate_argnums=(0, 1)),
                   lambda params: params)


def make_variants(config: DemoConfig) -> list[Variant]:
    lr, wd = config.learning_rate, config.weight_decay
    return [
        optax_variant("optax.adamw fp32", optax.adamw(lr, weight_decay=wd)),
        optax_variant("apexw bf16 (optax)", apexw(lr, weight_decay=wd, state_dtype=jnp.bfloat16)),
        optax_variant("apexw int8 (optax)", apexw(lr, weight_decay=wd, state_dtype=jnp.int8)),
        fused_variant(FUSED, ApexW(lr, weight_decay=wd, state_dtype=jnp.int8)),
    ]


def optimizer_state_bytes(state: Any) -> int:
    """Moment bytes of an ApexWState (``state_nbytes``), else every array leaf of an optax state."""
    if isinstance(state, ApexWState):
        return state_nbytes(state)
    return sum(leaf.nbytes for leaf in jax.tree.leaves(state) if hasattr(leaf, "nbytes"))


# ---------------------------------------------------------------------------------------------- steps


def train_optimizers(tour: Tour) -> None:
    """Trains the MLP with every variant from the same init on the same batches; fills optimizer_rows."""
    config = tour.config
    if tour.mnist is None:
        tour.mnist = load_mnist()
    mnist = tour.mnist
    epoch_steps = len(mnist.train_y) // config.batch_size
    steps = config.steps or epoch_steps
    order = np.random.default_rng(config.seed).permutation(len(mnist.train_y))
    order = np.resize(order, steps * config.batch_size)  # wraps into a second epoch only if steps asks for it
    train_x, train_y = jax.device_put(mnist.train_x[order]), jax.device_put(mnist.train_y[order])
    test_x, test_y = jax.device_put(mnist.test_x), jax.device_put(mnist.test_y)
    init_params = init_mlp(jax.random.key(config.seed))
    n_params = sum(leaf.size for leaf in jax.tree.leaves(init_params))
    tour.console.print(f"MLP {MNIST_PIXELS}-{'-'.join(map(str, HIDDEN))}-{MNIST_CLASSES} ({n_params:,} params) on "
                       f"MNIST: {steps} steps of {config.batch_size} images "
                       f"({steps / epoch_steps:.2f} epochs), lr {config.learning_rate}")

    columns = (TextColumn("{task.description:<26}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]:.4f}"), TimeElapsedColumn())
    with Progress(*columns, console=tour.console) as progress:
        for variant in make_variants(config):
            task = progress.add_task(variant.name, total=steps, loss=float("nan"))
            carry, state = variant.init(jax.tree.map(jnp.copy, init_params))  # steps donate their inputs
            state_bytes = optimizer_state_bytes(state)
            losses, times = np.zeros(steps, np.float32), np.zeros(steps)
            for i in range(steps):
                batch = slice(i * config.batch_size, (i + 1) * config.batch_size)
                x, y = train_x[batch], train_y[batch]
                start = time.perf_counter()
                carry, state, loss = jax.block_until_ready(variant.step(carry, state, x, y))
                times[i] = time.perf_counter() - start
                losses[i] = loss
                progress.update(task, advance=1, loss=losses[max(0, i - LOSS_WINDOW + 1): i + 1].mean())
            test_accuracy = float(accuracy(variant.tree(carry), test_x, test_y))
            tour.optimizer_rows.append(OptimizerRow(variant.name, losses, test_accuracy, state_bytes, n_params,
                                                    float(np.median(times[1:])) * 1e3))
            tour.results[variant.name] = (carry, state)


def checkpoint_round_trip(tour: Tour) -> None:
    """Saves the fused variant's params and ApexWState with Checkpointer and restores them bit-exactly."""
    params, state = tour.results[FUSED]
    saved = {"params": params, "opt_state": state}
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), saved)  # nothing but shapes
    with tempfile.TemporaryDirectory() as directory, Checkpointer(directory, handle_sigterm=False) as ckpt:
        step = int(state.count)
        ckpt.save(step, saved)
        restored = ckpt.restore(target)
    leaves, restored_leaves = jax.tree.leaves(saved), jax.tree.leaves(restored)
    same_types = jax.tree.structure(restored) == jax.tree.structure(saved)
    same_bits = all(np.asarray(a).dtype == np.asarray(b).dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
                    for a, b in zip(leaves, restored_leaves, strict=True))
    if not (same_types and same_bits):
        raise RuntimeError(f"checkpoint round trip changed the tree (same pytree types: {same_types}, "
                           f"same bits: {same_bits})")
    nbytes = sum(leaf.nbytes for leaf in leaves)
    tour.results["checkpoint"] = restored
    tour.results["checkpoint_bytes"] = nbytes
    tour.console.print(f"checkpoint: params + ApexWState (int8) at step {step} saved and restored "
                       f"bit-exactly ({len(leaves)} arrays, {nbytes:,} bytes)")


def optimizer_table(tour: Tour) -> None:
    table = Table(title=f"ApexW on MNIST ({tour.optimizer_rows[0].losses.size} steps)")
    for column in ("variant", "train loss", "test acc", "state bytes", "B/param", "step ms"):
        table.add_column(column, justify="left" if column == "variant" else "right", no_wrap=column == "variant")
    for row in tour.optimizer_rows:
        table.add_row(row.variant, f"{row.final_loss:.4f}", f"{row.test_accuracy:.2%}", f"{row.state_bytes:,}",
                      f"{row.bytes_per_param:.2f}", f"{row.step_ms:.2f}")
    tour.console.print(table)


PC_NET = PCNet((MNIST_PIXELS, 512, 512, MNIST_CLASSES), activation="sigmoid", output="cross_entropy",
               input_activation=False)  # pixels enter linearly: sigmoid would squash [0, 1] into [0.5, 0.73]
PC_T, PC_DT, PC_BATCH = 20, 0.1, 250


def predictive_coding_epoch(tour: Tour) -> None:
    """One epoch (or ``steps`` minibatches) of supervised PC on MNIST; prints time and test accuracy."""
    mnist = tour.mnist or load_mnist()
    limit = None if tour.config.steps is None else tour.config.steps * PC_BATCH
    images, labels = jnp.asarray(mnist.train_x[:limit]), jnp.asarray(mnist.train_y[:limit])
    optimizer = optax.adamw(tour.config.learning_rate, weight_decay=tour.config.weight_decay)
    params = init_params(jax.random.key(tour.config.seed), PC_NET)
    with tour.console.status(f"predictive coding: {images.shape[0]:,} images, T={PC_T} settling steps each"):
        start = time.perf_counter()
        params, _, metrics = train_epoch(params, optimizer.init(params), optimizer, images, labels, net=PC_NET,
                                         T=PC_T, dt=PC_DT, batch_size=PC_BATCH, key=jax.random.key(1))
        jax.block_until_ready(params)
        seconds = time.perf_counter() - start
    accuracy = evaluate(params, jnp.asarray(mnist.test_x), jnp.asarray(mnist.test_y), PC_NET)
    tour.results["pc_test_accuracy"] = accuracy
    tour.console.print(f"PC {'-'.join(map(str, PC_NET.sizes))} sigmoid, T={PC_T} Euler, batch {PC_BATCH}: "
                       f"{images.shape[0]:,} images in {seconds:.1f} s (compile included), energy "
                       f"{float(metrics['energy']):.3f}, test accuracy {accuracy:.2%}")


def serving_chat(tour: Tour) -> None:
    """SmolLM2 behind the OpenAI-compatible server on loopback: one chat request, its reply and speed."""
    from examples.serving_client import demo_round_trip  # the serving part loads its model only when this step runs

    with tour.console.status("serving: loading SmolLM2-135M-Instruct and starting the server on 127.0.0.1"):
        result = demo_round_trip()
    tour.results["serving"] = result
    tour.console.print(f"server {result['url']}: {result['reply']!r} ({result['completion_tokens']} tokens streamed "
                       f"at {result['tokens_per_s']:.1f} tokens/s after a first token in {result['ttft_s']:.2f} s, "
                       f"batch 1 on this CPU; the first request, after {result['warm_up_s']:.0f} s of warm-up "
                       "compiles)")


def summary(tour: Tour) -> None:
    """One table: a line per part that ran, what it showed and its wall time; then the total against BUDGET_S."""
    table = Table(title="apex-jax tour")
    for column in ("part", "result", "s"):
        table.add_column(column, justify="right" if column == "s" else "left")
    seconds = lambda *names: f"{sum(tour.seconds.get(n, 0.0) for n in names):.1f}"
    rows = {row.variant: row for row in tour.optimizer_rows}
    if FUSED in rows and REFERENCE in rows:
        fused, reference = rows[FUSED], rows[REFERENCE]
        table.add_row("apex_jax", f"{FUSED}: {fused.bytes_per_param:.2f} B/param of state vs "
                      f"{reference.bytes_per_param:.2f}, test acc {fused.test_accuracy:.2%} vs "
                      f"{reference.test_accuracy:.2%}", seconds("train_optimizers", "optimizer_table"))
    if "checkpoint_bytes" in tour.results:
        table.add_row("checkpoint", f"{tour.results['checkpoint_bytes']:,} bytes restored bit-exactly",
                      seconds("checkpoint_round_trip"))
    if "pc_test_accuracy" in tour.results:
        table.add_row("pc", f"one epoch, test acc {tour.results['pc_test_accuracy']:.2%}",
                      seconds("predictive_coding_epoch"))
    if "serving" in tour.results:
        served = tour.results["serving"]
        table.add_row("serving", f"SmolLM2 {served['tokens_per_s']:.1f} tokens/s: {served['reply'][:40]!r}",
                      seconds("serving_chat"))
    tour.console.print(table)
    total = sum(tour.seconds.values())
    verdict = "within" if total <= BUDGET_S else "OVER"
    tour.console.print(f"total {total:.0f} s, {verdict} the {BUDGET_S} s budget")


STEPS: list[DemoStep] = [
    DemoStep("train MNIST with every optimizer variant", train_optimizers),
    DemoStep("checkpoint round trip", checkpoint_round_trip),
    DemoStep("optimizer table", optimizer_table),
    DemoStep("predictive coding: one epoch", predictive_coding_epoch),
    DemoStep("serving: SmolLM2 behind the OpenAI-compatible API", serving_chat),
    DemoStep("summary", summary),
]


def run(steps: int | None = None, batch_size: int = 128, console: Console | None = None,
        demo_steps: list[DemoStep] | None = None) -> Tour:
    """Runs the tour's steps in order and returns what they left.

    Args:
      steps: training steps per optimizer variant; None trains one epoch.
      batch_size: images per step.
      console: where to print (a quiet ``Console(file=io.StringIO())`` in tests); None prints to stdout.
      demo_steps: which steps to run; None runs all of :data:`STEPS`.
    """
    tour = Tour(DemoConfig(steps=steps, batch_size=batch_size), console or Console())
    for step in STEPS if demo_steps is None else demo_steps:
        tour.console.rule(step.name)
        start = time.perf_counter()
        step.run(tour)
        tour.seconds[step.run.__name__] = time.perf_counter() - start
        tour.console.print(f"[dim]{step.name}: {tour.seconds[step.run.__name__]:.1f} s[/dim]")
    return tour


if __name__ == "__main__":
    run()
