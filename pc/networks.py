"""Predictive-coding networks: the configuration, the parameters and the feed-forward pass.

Layers l = 0..L hold activities x_l ``[batch, n_l]``. Weight layer l (0 <= l < L) predicts layer l + 1:

    plain:     mu_{l+1} = a_l f_l(x_l) @ W_l + b_l
    residual:  mu_{l+1} = x_l + a_l f_l(x_l) @ W_l + b_l

f_l = f, except f_0 = identity with ``input_activation=False`` (the input enters linearly).

A plain net (the standard parameterisation) has a_l = 1 and W_l ~ N(0, gain^2 / n_l) (LeCun/He).

``residual=True`` is muPC (Innocenti, Achour & Buckley 2025): W_l ~ N(0, 1) for every layer, the scale moved
into fixed multipliers that keep each layer's contribution O(1) whatever the width N and the depth L (the number
of weight layers):

    a_0 = 1 / sqrt(n_0)            input layer (D = n_0 inputs)
    a_l = 1 / sqrt(N L)            residual block: hidden-to-hidden layers of equal width N = n_l (1 <= l <= L-2)
    a_l = 1 / sqrt(n_l)            a hidden layer that changes width (no skip connection)
    a_{L-1} = 1 / n_{L-1}          output layer (1/N: muP's readout, so the logits start near 0)

The 1/sqrt(L) in the blocks keeps the sum of L branches O(1) (Depth-muP); the 1/N readout makes the output's
update, not its initial value, O(1). The multipliers sit in the forward pass, so the weights' gradients carry
them too (dE/dW_l = -a_l f_l(x_l)^T e_{l+1}): with Adam, whose steps do not depend on the gradient's scale, every
layer moves by about the learning rate in W, i.e. by a_l times it in the function.

References:
  Whittington & Bogacz, "An Approximation of the Error Backpropagation Algorithm in a Predictive Coding
  Network with Local Hebbian Synaptic Plasticity", 2017;
  Innocenti, Achour & Buckley, "muPC: Scaling Predictive Coding to 100+ Layer Networks", 2025.
"""

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.pc_settle import PRECISIONS, dot_args

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "linear": lambda x: x,
}
OUTPUTS = ("gaussian", "cross_entropy")
# He et al. 2015: relu-like units halve the variance of what they pass on, so their weights get sqrt(2) more.
INIT_GAIN = {"relu": math.sqrt(2.0), "gelu": math.sqrt(2.0)}

Params = list[dict[str, jax.Array]]


@dataclasses.dataclass(frozen=True)
class PCNet:
    """A predictive-coding MLP (hashable, so it can be a static argument of ``jax.jit``).

    Args:
      sizes: widths n_0..n_L, at least two; n_0 is the clamped input (or the latent of a generative net).
      activation: f, one of :data:`ACTIVATIONS`.
      output: energy of a clamped output layer: "gaussian" (0.5 ||x_L - mu_L||^2) or "cross_entropy"
        (CE(softmax(mu_L), y)). A free output is always Gaussian.
      residual: muPC: the equal-width hidden-to-hidden layers become residual blocks and every layer takes
        muPC's multiplier a_l on standard Gaussian weights (module docstring).
      input_activation: apply f to x_0 too (Whittington & Bogacz).
        False feeds x_0 linearly, mu_1 = x_0 @ W_0 + b_0, as a plain MLP does: on raw pixels this trains
        sigmoid nets far faster (sigmoid squashes [0, 1] pixels into [0.5, 0.73]).
      precision: the matmul precision, not a dtype: how every matmul rounds its operands (it accumulates in
        float32), in the jnp loop and in the fused kernel alike. "float32" (IEEE, ``lax.Precision.HIGHEST``), "tf32"
        (``lax.Precision.DEFAULT``: TF32 tensor cores on an NVIDIA GPU, exact float32 on a CPU; what ``x @ w``
        gives) or "bfloat16" (operands rounded to bf16). The names are the fused kernel's
        (``pallas_kernels.pc_settle.PRECISIONS``); its ``dot_args`` maps each to an operand dtype and a
        ``lax.Precision``, for both paths. None (the default) picks "float32" for a residual net and "tf32" for
        a plain one: a residual block's error e = x_{l+1} - x_l - a f(x_l) W - b is a small difference of O(1)
        terms, which in the lower blocks of a deep net is as small as TF32's 2^-11 relative rounding of the
        matmul, and a muPC net trained at tf32 on a GPU fails where float32 trains (README, muPC).
    """

    sizes: tuple[int, ...]
    activation: str = "tanh"
    output: str = "gaussian"
    residual: bool = False
    input_activation: bool = True
    precision: str | None = None

    def __post_init__(self):
        if self.precision is None:
            object.__setattr__(self, "precision", "float32" if self.residual else "tf32")
        sizes = tuple(self.sizes)
        if len(sizes) < 2:
            raise ValueError(f"sizes needs at least 2 layers (input and output), got {sizes}")
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes):
            raise ValueError(f"sizes must be positive integers, got {sizes}")
        object.__setattr__(self, "sizes", sizes)
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; expected one of {tuple(ACTIVATIONS)}")
        if self.output not in OUTPUTS:
            raise ValueError(f"unknown output {self.output!r}; expected one of {OUTPUTS}")
        if self.output == "cross_entropy" and sizes[-1] < 2:
            raise ValueError(f"a cross_entropy output needs at least 2 classes, got sizes {sizes}")
        if self.residual and self.num_residual == 0:
            raise ValueError(f"residual=True needs two consecutive hidden layers of equal width; sizes {sizes} "
                             "have none")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; expected one of {PRECISIONS}")

    @property
    def depth(self) -> int:
        """L, the number of weight layers."""
        return len(self.sizes) - 1

    def is_residual(self, l: int) -> bool:
        """Whether weight layer l (x_l -> x_{l+1}) is a residual block."""
        return self.residual and 1 <= l <= self.depth - 2 and self.sizes[l] == self.sizes[l + 1]

    @property
    def num_residual(self) -> int:
        return sum(self.is_residual(l) for l in range(self.depth))

    def weight_scale(self, l: int) -> float:
        """a_l, the fixed multiplier of weight layer l (module docstring): 1 in a plain net, muPC's with residual."""
        if not self.residual:
            return 1.0
        n_in = self.sizes[l]
        if l == 0:
            return 1.0 / math.sqrt(n_in)
        if l == self.depth - 1:
            return 1.0 / n_in
        if self.is_residual(l):
            return 1.0 / math.sqrt(n_in * self.depth)
        return 1.0 / math.sqrt(n_in)

    @property
    def layer_runs(self) -> tuple[tuple[int, int], ...]:
        """The weight layers 0..L-1 as half-open runs ``(start, stop)``: each plain layer alone, consecutive
        residual blocks of one width together (they share shapes and a_l, so a run's matmuls batch into one)."""
        runs: list[tuple[int, int]] = []
        for l in range(self.depth):
            start = runs[-1][0] if runs else 0
            if runs and self.is_residual(l) and self.is_residual(start) and self.sizes[start] == self.sizes[l]:
                runs[-1] = (start, l + 1)
            else:
                runs.append((l, l + 1))
        return tuple(runs)

    @property
    def operand_dtype(self) -> jnp.dtype:
        """The dtype :attr:`precision` rounds matmul operands to (float32 for "float32" and "tf32")."""
        return dot_args(self.precision)[0]

    def matmul(self, a: jax.Array, w: jax.Array) -> jax.Array:
        """``a @ w`` at the net's :attr:`precision`, float32 result."""
        dtype, precision = dot_args(self.precision)
        return jnp.matmul(a.astype(dtype), w.astype(dtype), precision=precision, preferred_element_type=jnp.float32)

    def f(self, l: int) -> Callable[[jax.Array], jax.Array]:
        """f_l, the activation applied to x_l before weight layer l."""
        return ACTIVATIONS["linear" if l == 0 and not self.input_activation else self.activation]


def parse_arch(spec: str) -> tuple[int, ...]:
    """Layer widths from a dash-separated string; ``W*K`` repeats a width K times.

    Example:
      >>> parse_arch("784-512-512-10")
      (784, 512, 512, 10)
      >>> parse_arch("784-128*3-10")
      (784, 128, 128, 128, 10)
    """
    sizes: list[int] = []
    for part in spec.replace(" ", "").split("-"):
        width, _, repeat = part.partition("*")
        try:
            n, k = int(width), int(repeat or 1)
        except ValueError:
            raise ValueError(f"bad layer {part!r} in architecture {spec!r}: expected N or N*K, e.g. "
                             "'784-512-512-10' or '784-128*64-10'") from None
        if n < 1 or k < 1:
            raise ValueError(f"bad layer {part!r} in architecture {spec!r}: widths and repeats must be >= 1")
        sizes += [n] * k
    if len(sizes) < 2:
        raise ValueError(f"architecture {spec!r} needs at least 2 layers, e.g. '784-10'")
    return tuple(sizes)


def init_params(key: jax.Array, net: PCNet) -> Params:
    """W_l ~ N(0, gain^2 / n_l) (LeCun/He by activation), or N(0, 1) with muPC (``net.residual``); b_l = 0.

    Returns:
      ``[{"w": [n_l, n_{l+1}], "b": [n_{l+1}]} for l in 0..L-1]``, float32.
    """
    gain = INIT_GAIN.get(net.activation, 1.0)
    keys = jax.random.split(key, net.depth)
    std = lambda n_in: 1.0 if net.residual else gain / math.sqrt(n_in)
    return [{"w": std(n_in) * jax.random.normal(k, (n_in, n_out), jnp.float32),
             "b": jnp.zeros((n_out,), jnp.float32)}
            for k, n_in, n_out in zip(keys, net.sizes[:-1], net.sizes[1:], strict=True)]


def predict(layer: dict[str, jax.Array], x: jax.Array, net: PCNet, l: int,
            fx: jax.Array | None = None) -> jax.Array:
    """mu_{l+1} ``[batch, n_{l+1}]`` from x_l ``[batch, n_l]`` through weight layer l (``fx``: f_l(x_l) if known).

    Also a whole run of residual blocks l..l+k-1 (:attr:`PCNet.layer_runs`) at once: x ``[k, batch, n]``, ``layer``
    from :func:`stack_run`, mu ``[k, batch, n]``."""
    branch = net.weight_scale(l) * net.matmul(net.f(l)(x) if fx is None else fx, layer["w"])
    if net.is_residual(l):
        return x + branch + layer["b"]
    return branch + layer["b"]


def stack_run(params: Params, start: int, stop: int) -> dict[str, jax.Array]:
    """Weight layers start..stop-1 as one layer for :func:`predict`: w ``[k, n, n]``, b ``[k, 1, n]``; a single
    layer as it is."""
    if stop - start == 1:
        return params[start]
    return {"w": jnp.stack([p["w"] for p in params[start:stop]]),
            "b": jnp.stack([p["b"] for p in params[start:stop]])[:, None, :]}


def stack_layers(xs: list[jax.Array], start: int, stop: int) -> jax.Array:
    """Activities x_start..x_{stop-1} as ``[k, batch, n]``; a single one as it is ``[batch, n]``."""
    return xs[start] if stop - start == 1 else jnp.stack(xs[start:stop])


def forward(params: Params, x: jax.Array, net: PCNet) -> list[jax.Array]:
    """The feed-forward pass x_{l+1} = mu_{l+1}(x_l): all activities ``[x_0 [batch, n_0], ..., x_L]``."""
    check_params(params, net)
    xs = [x]
    for l, layer in enumerate(params):
        xs.append(predict(layer, xs[-1], net, l))
    return xs


def check_params(params: Params, net: PCNet) -> None:
    """Raise ValueError unless ``params`` has the shapes ``init_params`` gives ``net``."""
    if len(params) != net.depth:
        raise ValueError(f"params have {len(params)} layers, net {net.sizes} needs {net.depth}")
    for l, (layer, n_in, n_out) in enumerate(zip(params, net.sizes[:-1], net.sizes[1:], strict=True)):
        if tuple(layer["w"].shape) != (n_in, n_out) or tuple(layer["b"].shape) != (n_out,):
            raise ValueError(f"params[{l}] has w {tuple(layer['w'].shape)}, b {tuple(layer['b'].shape)}; "
                             f"net {net.sizes} needs w {(n_in, n_out)}, b {(n_out,)}")
