"""One scheduler step -> two device calls: the model's forward pass, then the sampler.

The flat batch of N new tokens from S sequences is padded to buckets: N to powers of two (from
``MIN_TOKENS_BUCKET``; a decode step's from ``MIN_DECODE_BUCKET``, by platform), the block-table width W to powers
of four (``blocks_bucket``), so the number of compiles stays bounded (log2 and log4 of the ranges). A runner made
with ``max_blocks`` (the widest table a sequence can have) on a GPU whose attention kernels read each token's pages
only up to its length (``layers.reads_pages_by_length``) pads every table to that one width instead: a wider
table then costs an int32 per column and sequence and no attention work, and a step shape per context bucket
would multiply the compiles. A runner made with ``max_seqs`` pads S to
``min(max(N, MIN_SEQS_BUCKET), bucket(max_seqs))``, a function of N: the step shapes are then the pairs (N, W)
(N alone, with one width) and no more, few enough to compile them all before serving
(``step_shapes``, ``build_step``, ``build_sample``, ``build_decode``: the very calls ``run`` and ``decode`` make,
compiled ahead of time into the runner's ``executables``, where they find them). The cache is donated: the forward pass
updates it in place, and no array goes back to the host between layers. Per call the host gets the sampled
token of every sequence (the logits at its chunk's last token), their logprobs, and the per-layer expert
counts, which the runner sums into ``expert_load [layers, experts]``. The attention kernels' metadata
(``kv_lens``, ``chunk_starts``) comes with the batch from ``make_batch``, on the host, once per step, and goes to
the device with the tokens and last indices as one buffer (``kv_cache.pack_step``: one copy per step); the
compiled step is keyed on the runner's ``kernels`` (a ``layers.KernelPolicy``: which implementation each layer
runs) and on whether it is a decode step (one token per sequence after its cached context). A decode step's tokens
is traced with ``KernelPolicy.paged_only``, with no packed prefill attention (only where the kernels are traced,
``layers.traces_kernels``: the references read the pages either way). Every step is also fed a vector of F tokens
on the device (``fed``, F = ``fed_size``: the widest S, so that any step's samples feed any other step): a packed
token id ``-1 - r`` stands for ``fed[r]``, so a step dispatched behind another one (``dispatch(previous=...)``)
reads the tokens that one samples without their going through the host, while its other tokens (a prompt's) come
from the host as usual. A runner made with ``batch_invariant=True`` runs both calls through ``serving.batch_invariant``
(policy ``layers.BATCH_INVARIANT``): a sequence's logits, tokens and logprobs are then bitwise the same in any
batch and any chunking. A runner made with a ``mesh`` (its params and cache already placed on it,
``serving.sharding``) runs both calls under ``jax.set_mesh(mesh)``, so the MoE layers go expert-parallel, with the
packed buffer replicated.

A vision-language model's steps also take ``images.MultimodalInputs`` (``images.step_inputs`` of the chunks'
``RequestImages``: the tokens' multimodal RoPE shifts and, in a prefill chunk over an image, its rows), given to the
forward pass as ``mm``; a step without images passes none (the text families' own trace). ``encode_images`` runs
the image encoder once over every image of the requests it is given (patches padded to a power-of-two bucket, one
compile per bucket) and keeps each request's embeddings on the host, where the steps' rows are cut from them.

A step that scores prompt tokens (``dispatch(targets=...)``: a request with ``SamplingParams.prompt_logprobs``
prefilling) is a variant of the general step, traced apart, so the common steps keep their executables and cost:
besides the last-token logits it returns, for every flat token t with target y_t (the prompt's next token),
``log_softmax(z_t)[y_t]`` and the top ``MAX_LOGPROBS`` of ``log_softmax(z_t)``, where ``z_t [V]`` are the float32
logits at t. Under causal attention z_t depends on the tokens up to t only, so those are the prompt's teacher-forced
logprobs whatever the chunking.

A multi-step decode (``ModelRunner.dispatch_decode``) runs ``steps`` forward + sample iterations in one jitted call
(``lax.scan``): a batch where every sequence decodes one token, its blocks for all ``steps`` tokens already in its
block table; each iteration's sampled tokens are the next one's inputs, the batch moves one position on
(``kv_cache.next_decode_batch``) and so does the sampling state (``sampler.advance``: the positions randomness is
folded with, the penalized histories). The host gets the ``[S, steps]`` tokens (with their logprobs when asked
for) and the summed expert counts in one transfer. Its tokens are those of ``steps`` single steps of the same
batch.

``run`` is ``fetch(dispatch(...))``: ``dispatch`` returns as soon as the device calls are queued, so the engine can
queue the next step behind it (``dispatch(previous=...)``: a token id ``from_previous(r)`` is row r of ``previous``'s
samples, read on the device) before it waits for the first one's tokens.

Structured output costs no device time of its own: the forward pass is dispatched asynchronously, and while the
device runs it the host packs the constrained rows' allowed tokens (``fill_token_bitmask``, llguidance's thread
pool) and the sampling parameters; the sampler, dispatched next, applies the packed ``[S, ceil(V / 32)]`` int32
mask. A step without constrained rows does no mask work and sends no mask.
"""

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from serving import batch_invariant, layers
from serving.config import ModelConfig
from serving.engine.executables import Executables
from serving.engine.sampler import (
    SampleResult,
    SampleRow,
    SamplingBatch,
    advance,
    sample,
    sampling_batch,
    token_logprobs,
    with_room,
)
from serving.engine.sampling_params import MAX_LOGPROBS
from serving.images import MultimodalInputs, RequestImages, step_inputs
from serving.kv_cache import AttentionBatch, SeqChunk, make_batch, next_decode_batch, pack_step, unpack_step
from serving.models.vision import patch_layout
from serving.structured import fill_token_bitmask

MIN_TOKENS_BUCKET = 8  # the smallest padded N of a step
# The smallest padded N of a decode step, by platform (else MIN_TOKENS_BUCKET). On a GPU decode batches of up to 8
# sequences share one compile: a step's time hardly depends on so small an N. On a CPU every matmul of a decode step
# is a memory-bound matrix-vector product whose time grows with N, so a decode step's N is padded no further than
# it needs. S is padded to at least MIN_SEQS_BUCKET either way, so the sampler's shapes stay few.
MIN_DECODE_BUCKET = {"cpu": 1}
MIN_SEQS_BUCKET = 8
# The narrowest padded block table: contexts up to 16 blocks (256 tokens at block size 16) share one compile, and
# attention's splits of a wider real context are unchanged.
MIN_BLOCKS_BUCKET = 16
# Block-table widths grow by 4x per bucket (16, 64, 256, ...): the paged kernel's loop stops at each token's own
# length, so a wider table costs one int32 row per sequence, while every width bucket multiplies the shapes to
# compile before serving.
BLOCKS_BUCKET_BASE = 4
MIN_PATCHES_BUCKET = 64  # the smallest padded patch count of an encoder call (a multiple of every merge unit)


def bucket(n: int, minimum: int = 1, base: int = 2) -> int:
    """The least ``minimum * base**e`` >= n (e >= 0; ``minimum`` a power of two, ``base`` a power of two)."""
    if minimum < 1 or minimum & (minimum - 1):
        raise ValueError(f"bucket: minimum {minimum} is not a power of two")
    value = minimum
    while value < n:
        value *= base
    return value


def buckets(limit: int, minimum: int = 1, base: int = 2) -> list[int]:
    """Every value ``bucket(n, minimum, base)`` takes for 1 <= n <= limit, ascending."""
    values = [bucket(1, minimum, base)]
    while values[-1] < limit:
        values.append(values[-1] * base)
    return values


def blocks_bucket(n: int) -> int:
    """The padded block-table width of a step whose widest sequence holds ``n`` blocks."""
    return bucket(n, MIN_BLOCKS_BUCKET, BLOCKS_BUCKET_BASE)


class StepShape(NamedTuple):
    """The static sizes of one compiled forward step: N tokens, S sequences, W block-table columns, and whether it
    is traced with ``KernelPolicy.paged_only``."""

    num_tokens: int
    num_seqs: int
    max_blocks: int
    paged_only: bool


class StepResult(NamedTuple):
    tokens: np.ndarray  # [S] sampled token per chunk (meaningful where the chunk samples)
    logprobs: np.ndarray  # [S] logprob of that token
    top_ids: np.ndarray  # [S, num_top]
    top_logprobs: np.ndarray  # [S, num_top]
    expert_counts: np.ndarray  # [layers, experts] tokens routed to each expert this step
    # [N] per flat token: the logprob of its target (the next prompt token) and the top MAX_LOGPROBS, when the step
    # was dispatched with targets (``ModelRunner.dispatch``); else None
    prompt: SampleResult | None = None


def from_previous(row: int) -> int:
    """The token id that stands for row ``row`` of the samples of the step dispatched before (``fed_tokens``)."""
    return -1 - row


def fed_tokens(tokens: jax.Array, fed: jax.Array) -> jax.Array:
    """A step's token ids: ``tokens`` as packed, where an id ``-1 - r`` stands for ``fed[r]`` (a token the step
    before sampled, still on the device)."""
    return jnp.where(tokens < 0, fed[jnp.maximum(-1 - tokens, 0)], tokens)


@functools.partial(jax.jit, static_argnames=("sizes", "forward", "cfg", "kernels"), donate_argnames="kv")
def _step(params: dict, kv: Any, packed: jax.Array, fed: jax.Array,
          mm: MultimodalInputs | None = None, targets: jax.Array | None = None, *, sizes: tuple[int, int, int],
          forward: Callable, cfg: ModelConfig,
          kernels: layers.KernelPolicy) -> tuple[jax.Array, Any, jax.Array, SampleResult | None]:
    """forward over the step's tokens ``[N]`` (its layers run as the policy ``kernels`` says): the logits
    ``[S, V]`` at each chunk's last flat index, the updated cache, the expert counts ``[layers, experts]``, and the
    scores of ``targets`` (None without them). ``packed``: ``kv_cache.pack_step``'s buffer of the tokens, batch and
    last indices for ``sizes = (N, S, max_blocks)``, its token ids resolved against ``fed [F]`` (``fed_tokens``);
    ``mm``: a vision-language step's image inputs; ``targets [N]`` (a trace of its own): every flat position's
    ``token_logprobs(logits [N, V], targets, MAX_LOGPROBS)``, so a prompt position p with target ``prompt[p + 1]``
    gets ``log P(prompt[p + 1] | prompt[:p + 1])`` and the top of that distribution."""
    tokens, batch, last = unpack_step(packed, *sizes)
    tokens = fed_tokens(tokens, fed)
    rows = None if targets is not None else last  # a scoring step needs every token's logits, others the last's

    def model(params, tokens, batch, kv):
        extra = () if mm is None else (mm,)
        return forward(params, cfg, tokens, batch, kv, *extra, kernels=kernels, rows=rows)

    if kernels.batch_invariant:  # every matmul and sum at a fixed geometry (serving.batch_invariant)
        model = batch_invariant.invariant(model)
    logits, kv, expert_counts = model(params, tokens, batch, kv)
    if targets is None:
        return logits, kv, expert_counts, None
    score = functools.partial(token_logprobs, num_top=MAX_LOGPROBS)
    scores = (batch_invariant.invariant(score) if kernels.batch_invariant else score)(logits, targets)
    return logits[last], kv, expert_counts, scores


class DecodeResult(NamedTuple):
    tokens: np.ndarray  # [S, steps] each sequence's sampled tokens, in order
    expert_counts: np.ndarray  # [layers, experts] tokens routed to each expert over the steps
    logprobs: np.ndarray  # [S, steps] logprob of each token
    top_ids: np.ndarray  # [S, steps, num_top]
    top_logprobs: np.ndarray  # [S, steps, num_top]


@functools.partial(jax.jit, static_argnames=("sizes", "steps", "block_size", "forward", "cfg", "kernels", "draw",
                                             "num_top"), donate_argnames="kv")
def _decode_steps(params: dict, kv: Any, packed: jax.Array, fed: jax.Array, sampling: SamplingBatch,
                  mm: MultimodalInputs | None = None, *, sizes: tuple[int, int, int], steps: int, block_size: int,
                  forward: Callable, cfg: ModelConfig, kernels: layers.KernelPolicy, draw: bool,
                  num_top: int) -> tuple[SampleResult, jax.Array, Any, jax.Array]:
    """``steps`` decode iterations of forward (policy ``kernels``, paged only) + ``sample``: the
    samples (tokens ``[steps, S]``, their logprobs and top ``num_top``), the last iteration's tokens as a fed vector
    ``[F]`` (a chained step's inputs), the updated cache and the expert counts ``[layers, experts]`` summed over the
    steps. ``packed``: ``pack_step``'s buffer of a batch with one paged token per sequence, ``sizes = (N, S,
    max_blocks)``, its token ids resolved against ``fed [F]`` (``fed_tokens``); ``mm``: the tokens' multimodal RoPE
    shifts (constant as the positions move on)."""
    tokens, batch, last = unpack_step(packed, *sizes)
    real = batch.seq_ids >= 0
    tokens = fed_tokens(tokens, fed)
    extra = () if mm is None else (mm,)

    def one_step(carry, _):
        kv, tokens, batch, sampling, counts = carry
        logits, kv, step_counts = forward(params, cfg, tokens, batch, kv, *extra,
                                          kernels=dataclasses.replace(kernels, paged_only=True), rows=last)
        result = sample(logits, sampling, num_top=num_top, draw=draw)
        tokens = jnp.where(real, result.tokens[jnp.maximum(batch.seq_ids, 0)], 0)
        carry = kv, tokens, next_decode_batch(batch, block_size), advance(sampling, result.tokens), counts + step_counts
        return carry, result

    counts = jnp.zeros((cfg.layers, cfg.num_experts), jnp.int32)
    (kv, *_, counts), sampled = jax.lax.scan(one_step, (kv, tokens, batch, with_room(sampling, steps), counts),
                                             length=steps)
    return sampled, jnp.zeros_like(fed).at[:sizes[1]].set(sampled.tokens[-1]), kv, counts


@functools.partial(jax.jit, static_argnames=("encode", "cfg", "kernels"))
def _encode(params: dict, pixels: jax.Array, layout: Any, *, encode: Callable, cfg: ModelConfig,
            kernels: layers.KernelPolicy) -> tuple[jax.Array, jax.Array]:
    return encode(params, cfg, pixels, layout, kernels)


@functools.partial(jax.jit, static_argnames=("num_top", "draw"))
def _invariant_sample(logits: jax.Array, sampling: SamplingBatch, num_top: int, draw: bool) -> SampleResult:
    """``sampler.sample`` with its sums at a fixed geometry (``serving.batch_invariant``)."""
    return batch_invariant.invariant(functools.partial(sample, num_top=num_top, draw=draw))(logits, sampling)


@functools.partial(jax.jit, static_argnames=("sampler", "num_top", "draw", "fed_size"))
def _sample_fed(logits: jax.Array, sampling: SamplingBatch, *, sampler: Callable, num_top: int, draw: bool,
                fed_size: int) -> tuple[SampleResult, jax.Array]:
    """``sampler``'s samples of a step's logits ``[S, V]`` and its tokens as a fed vector ``[fed_size]`` (the first
    S entries; the inputs of a step chained after it)."""
    result = sampler(logits, sampling, num_top=num_top, draw=draw)
    return result, jnp.zeros(fed_size, jnp.int32).at[:result.tokens.shape[0]].set(result.tokens)


class Dispatched(NamedTuple):
    """A step on its way: its samples and expert counts on the device (``ModelRunner.fetch``, or ``fetch_decode``
    for a multi-step decode, brings them back)."""

    result: SampleResult  # [S] (a step), [steps, S] (a multi-step decode)
    expert_counts: jax.Array
    num_chunks: int
    num_tokens: int  # the padded N
    fed: jax.Array  # [F] its (last) samples, as the fed vector of a step chained after it
    prompt: SampleResult | None = None  # the step's ``_step`` scores, when dispatched with targets


class ModelRunner:
    """Holds the params and the cache of one model and runs scheduled steps on them.

    ``overlap_masks`` (default True) computes structured-output masks while the forward pass runs; False computes
    them before it is dispatched (the same tokens; for comparison). ``mask_seconds`` sums the host time spent
    computing masks. ``mesh``: the mesh params and kv are placed on (None: one device). ``max_seqs``: the most
    sequences a step holds; given, S is padded to ``min(max(N, MIN_SEQS_BUCKET), bucket(max_seqs))`` (module
    docstring), else to ``bucket(S)``. ``kernels``: which implementation each layer runs (``layers.KernelPolicy``;
    default the fastest measured on the launch target); ``batch_invariant=True`` replaces it with
    ``layers.BATCH_INVARIANT``. ``encode``: a vision-language model's ``encode_images`` (None: no image encoder).
    ``max_blocks``: the most blocks a sequence holds (None: unbounded), which fixes W where the kernels allow
    (``fixed_width``, module docstring). ``score_tokens``: the N every scoring step (``dispatch`` with targets) is
    padded to (None: its bucket), so that one shape of that variant serves them all: the bucket of the most tokens
    a step holds. Scoring prompts is an evaluation's batch work, which fills its steps anyway; its variant
    at every N would double the forward passes to compile before serving.
    """

    def __init__(self, cfg: ModelConfig, params: dict, forward: Callable, kv: Any, block_size: int,
                 batch_invariant: bool = False, mesh: Mesh | None = None, max_seqs: int | None = None,
                 kernels: layers.KernelPolicy = layers.DEFAULT, encode: Callable | None = None,
                 max_blocks: int | None = None, score_tokens: int | None = None):
        if not isinstance(kernels, layers.KernelPolicy):
            raise TypeError(f"ModelRunner: kernels={kernels!r}: expected a layers.KernelPolicy")
        self.batch_invariant = batch_invariant  # every step with policy layers.BATCH_INVARIANT (module docstring)
        self.kernels = layers.BATCH_INVARIANT if batch_invariant else kernels
        if mesh is None:  # quantized expert codes K-major where the Triton kernels run them (a copy of those leaves)
            params = layers.kernel_layout(params, self.kernels)
        self.cfg, self.params, self.forward, self.kv, self.block_size = cfg, params, forward, kv, block_size
        self.encode = encode
        self.mesh, self.max_seqs = mesh, max_seqs
        self.expert_load = np.zeros((cfg.layers, cfg.num_experts), np.int64)
        self.overlap_masks = True
        self.mask_seconds = 0.0
        self.tiers = None  # a kv_tiers.KVTiers whose queued copies run before each step (set by the engine)
        self.platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform  # "cpu", "gpu"
        self.min_decode_tokens = MIN_DECODE_BUCKET.get(self.platform, MIN_TOKENS_BUCKET)  # a decode step's smallest N
        self.max_blocks, self.score_tokens = max_blocks, score_tokens
        self.executables = Executables()  # the calls compiled before serving (Engine.warm_up gives it a folder)
        self._zeros: dict[int, jax.Array] = {}  # the fed vector of steps chained after none, by F
        # Every step's W where the attention reads pages only up to each token's length (module docstring); None:
        # W over its buckets.
        self.fixed_width = max_blocks if max_blocks is not None and self.platform == "gpu" and (
            layers.reads_pages_by_length(cfg, jax.tree.leaves(kv)[0].dtype, self.kernels)) else None

    def num_seqs(self, num_tokens: int, real: int) -> int:
        """The padded S of a step of ``real`` sequences with N = ``num_tokens`` (padded): N's, at least
        ``MIN_SEQS_BUCKET`` (rows past the real sequences are padding, however few tokens the step has)."""
        if self.max_seqs is None:
            return bucket(real)
        if real > self.max_seqs:
            raise ValueError(f"a step of {real} sequences: expected at most max_seqs={self.max_seqs}")
        return min(max(num_tokens, MIN_SEQS_BUCKET), bucket(self.max_seqs))

    def fed_size(self, num_seqs: int) -> int:
        """F, the length of the fed token vector of a step of S = ``num_seqs`` (module docstring): the widest S,
        ``bucket(max_seqs)``, so that every step's samples can feed every other step; a runner without ``max_seqs``
        (whose S has no bound) feeds each step its own S, and chains only steps of one S."""
        return num_seqs if self.max_seqs is None else bucket(self.max_seqs)

    def _fed(self, previous: "Dispatched | None", num_seqs: int) -> jax.Array:
        """A step's fed vector: ``previous``'s samples (on the device), or zeros (no token id of the step refers to
        it): a device array, never numpy (replicated on a mesh, else committed to the device where the cache is),
        so that its kind is one of those ``padding_feds`` gives warm-up. An argument kind a compiled call's runs
        have not met costs its next dispatch jax's slow path, on some request's TTFT."""
        size = self.fed_size(num_seqs)
        if previous is None:
            if size not in self._zeros:
                cache = jax.tree.leaves(self.kv)[0]
                placement = self._replicated or (cache.sharding if cache.committed else None)
                self._zeros[size] = jax.device_put(np.zeros(size, np.int32), placement)
            return self._zeros[size]
        if previous.fed.shape[0] != size:
            raise ValueError(f"a step of {num_seqs} sequences chained after one fed {previous.fed.shape[0]} tokens: "
                             f"expected {size} (a runner without max_seqs chains only steps of one S)")
        return previous.fed

    def padding_feds(self, num_seqs: int) -> list[jax.Array]:
        """Fed vectors of every kind a step of ``num_seqs`` sequences is called with, for warm-up's runs: on a mesh
        one (replicated); on one device an uncommitted and a committed one, since a step chained behind another
        takes that one's samples as they come, committed or not as its outputs happen to be (``_fed``)."""
        if self.mesh is not None:
            return [self._fed(None, num_seqs)]
        zeros, cache = np.zeros(self.fed_size(num_seqs), np.int32), jax.tree.leaves(self.kv)[0]
        return [jax.device_put(zeros), jax.device_put(zeros, cache.sharding)]

    def table_width(self, widest: int) -> int:
        """The padded block-table width W of a step whose widest sequence holds ``widest`` blocks: the runner's
        ``fixed_width`` where it has one, else ``blocks_bucket(widest)``."""
        if self.fixed_width is None:
            return blocks_bucket(widest)
        if widest > self.fixed_width:
            raise ValueError(f"a step with a sequence of {widest} blocks: expected at most max_blocks="
                             f"{self.fixed_width}")
        return self.fixed_width

    def prepare(self, chunks: list[SeqChunk], token_ids: list[list[int]], num_tokens: int | None = None,
                previous: "Dispatched | None" = None) -> tuple[np.ndarray, AttentionBatch]:
        """Flat tokens ``[N]`` and batch metadata of ``chunks``, padded to the power-of-two buckets (N: to
        ``num_tokens`` if given, a bucket); token ids ``from_previous(r)`` name row r < S of ``previous``'s samples.
        Every device call of a step comes through here first: the cache tiers' queued copies are issued now, so the
        step reads the blocks they load."""
        if self.tiers is not None:
            with self.on_mesh():
                self.kv = self.tiers.apply(self.kv)
        total = sum(c.count for c in chunks)
        widest = max(len(c.block_table) for c in chunks)
        num_tokens = bucket(total, MIN_TOKENS_BUCKET) if num_tokens is None else num_tokens
        batch = make_batch(chunks, self.block_size, num_tokens=num_tokens,
                           num_seqs=self.num_seqs(num_tokens, len(chunks)),
                           max_blocks=self.table_width(widest))
        tokens = np.zeros(batch.positions.shape, np.int32)
        tokens[:total] = np.concatenate(token_ids)
        lowest = int(tokens.min(initial=0))
        if lowest < 0 and (previous is None or from_previous(lowest) >= previous.num_chunks):
            raise ValueError(f"token id {lowest}: a row of the previous step's samples, but "
                             + ("no step was given" if previous is None else
                                f"it sampled {previous.num_chunks} rows"))
        return tokens, batch

    def encode_images(self, requests: list[RequestImages]) -> None:
        """Run the image encoder once over every image of ``requests`` (their patches in one call, each image its
        own attention sequence) and give each request the call's tokens and DeepStack features (device arrays, not
        waited for) and its first row in them."""
        if self.encode is None:
            raise ValueError(f"model family {self.cfg.family!r} has no image encoder: expected requests without "
                             "images")
        images = [image for request in requests for image in request.images]
        total = sum(len(image.pixels) for image in images)
        layout = patch_layout(self.cfg.vision, [image.grid for image in images], bucket(total, MIN_PATCHES_BUCKET))
        pixels = np.zeros((len(layout.pos_index), self.cfg.vision.patch_dim), np.float32)
        pixels[:total] = np.concatenate([image.pixels for image in images])
        with self.on_mesh():
            tokens, deepstack = _encode(self.params, self.place(pixels), jax.tree.map(self.place, tuple(layout)),
                                        encode=self.encode, cfg=self.cfg, kernels=self.kernels)
        first = 0
        for request in requests:  # the outputs stay on the device: each step gathers its rows there
            request.embeds, request.deepstack, request.first_row = tokens, deepstack, first
            first += sum(end - start for start, end in request.spans)

    def _multimodal(self, images: list[RequestImages | None] | None, chunks: list[SeqChunk],
                    num_tokens: int) -> MultimodalInputs | None:
        """The step's ``MultimodalInputs`` (placed as its inputs are), None without images."""
        if images is None:
            return None
        mm = step_inputs([(i, c.start, c.count) for i, c in zip(images, chunks, strict=True)], num_tokens)
        return None if mm is None else jax.tree.map(self.place, mm)

    def on_mesh(self) -> contextlib.AbstractContextManager:
        """The context device calls on the runner's params and cache run in: ``jax.set_mesh(mesh)``, or nothing
        without a mesh."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def _packed(self, tokens: np.ndarray, batch: AttentionBatch, last: np.ndarray) -> Any:
        """``pack_step``'s one buffer of a step's inputs; on a mesh, replicated (every device reads the whole batch)."""
        return self.place(pack_step(tokens, batch, last))

    def place(self, inputs: Any) -> Any:
        """A step's ``inputs`` as its jitted call takes them: as they are, or replicated on the mesh."""
        return inputs if self.mesh is None else jax.device_put(inputs, self._replicated)

    @property
    def _replicated(self) -> NamedSharding | None:
        return None if self.mesh is None else NamedSharding(self.mesh, P())

    def step_kernels(self, paged_only: bool) -> layers.KernelPolicy:
        """The policy a step is traced with: the runner's ``kernels``, every token paged where ``paged_only``."""
        return dataclasses.replace(self.kernels, paged_only=paged_only)

    def _is_decode(self, chunks: list[SeqChunk]) -> bool:
        """Whether the step runs as a decode step (paged only, N from ``min_decode_tokens``): one token per chunk,
        each after its cached context. Not in batch-invariant mode."""
        return not self.batch_invariant and all(c.count == 1 and c.start > 0 for c in chunks)

    def decode_tokens(self, num_seqs: int) -> int:
        """N of a decode step of ``num_seqs`` sequences: one token each, padded to ``min_decode_tokens``' buckets."""
        return bucket(num_seqs, self.min_decode_tokens)

    def _paged_only(self, decode: bool) -> bool:
        """Trace the step with ``KernelPolicy.paged_only``: a decode step, with kernels that read the flag. Other steps,
        all-paged ones included (chunks continuing a cached prefix), take the general path, right for any batch:
        a paged-only twin of every prefill shape would double the shapes to compile for a saving of one unused
        packed attention."""
        return decode and not self.batch_invariant and layers.traces_kernels(self.kernels)

    def run(self, chunks: list[SeqChunk], token_ids: list[list[int]], rows: list[SampleRow],
            num_top: int = 0, images: list[RequestImages | None] | None = None,
            targets: list[list[int]] | None = None) -> StepResult:
        """Run ``chunks`` (with their new ``token_ids``; with their ``images``, one entry or None per chunk) and
        sample one token per chunk from ``rows``; with ``targets`` (``dispatch``), score them too."""
        return self.fetch(self.dispatch(chunks, token_ids, rows, num_top, images=images, targets=targets))

    def dispatch(self, chunks: list[SeqChunk], token_ids: list[list[int]], rows: list[SampleRow], num_top: int = 0,
                 previous: Dispatched | None = None, images: list[RequestImages | None] | None = None,
                 targets: list[list[int]] | None = None) -> Dispatched:
        """``run``'s device calls, not waited for. With ``previous`` (a step still on the device), a token id
        ``from_previous(r)`` in ``token_ids`` is row r of the tokens ``previous`` samples (its last, for a
        multi-step decode). ``targets``: one token per chunk token (as ``token_ids``; any id where no score is
        wanted): the step is then the scoring variant of the general path (``_step``), whose per-token scores
        ``fetch`` returns as ``StepResult.prompt``."""
        decode = targets is None and self._is_decode(chunks)
        num_tokens = None  # a general step's: prepare's bucket
        if targets is not None and self.score_tokens is not None:
            num_tokens = self.score_tokens
        if decode:
            num_tokens = self.decode_tokens(len(chunks))
        tokens, batch = self.prepare(chunks, token_ids, num_tokens, previous)
        num_seqs = batch.context_lens.shape[0]
        fed = self._fed(previous, num_seqs)
        last = np.zeros(num_seqs, np.int32)
        last[:len(chunks)] = np.cumsum([c.count for c in chunks]) - 1
        bitmask = None if self.overlap_masks else self._masks(rows, num_seqs)
        sizes = (len(tokens), num_seqs, batch.block_tables.shape[1])
        packed = self._packed(tokens, batch, last)
        mm = self._multimodal(images, chunks, len(tokens))
        flat_targets = None
        if targets is not None:
            flat_targets = np.zeros(len(tokens), np.int32)
            flat_targets[:sum(c.count for c in chunks)] = np.concatenate(targets)
            flat_targets = self.place(flat_targets)
        with self.on_mesh():
            logits, self.kv, counts, scores = self.executables.call(  # returns at once; the device computes
                "step", _step, (self.params, self.kv), (packed, fed, mm, flat_targets),
                self._step_static(sizes, self._paged_only(decode)))
            if self.overlap_masks:
                bitmask = self._masks(rows, num_seqs)
            result, next_fed = self.executables.call(
                "sample", _sample_fed, (), (logits, sampling_batch(rows, num_seqs, token_bitmask=bitmask)),
                self._sample_static(num_top, any(r.params.temperature > 0 for r in rows), num_seqs))
        return Dispatched(result, counts, len(chunks), len(tokens), next_fed, scores)

    def _sample_static(self, num_top: int, draw: bool, num_seqs: int) -> dict[str, Any]:
        """``_sample_fed``'s static arguments."""
        return dict(sampler=self._sampler, num_top=num_top, draw=draw, fed_size=self.fed_size(num_seqs))

    def _step_static(self, sizes: tuple[int, int, int], paged_only: bool) -> dict[str, Any]:
        """``_step``'s static arguments for a step of ``sizes = (N, S, W)``."""
        return dict(sizes=sizes, forward=self.forward, cfg=self.cfg, kernels=self.step_kernels(paged_only))

    def fetch(self, step: Dispatched) -> StepResult:
        """The host arrays of a dispatched step (waits for it)."""
        *sampled, counts, scores = jax.device_get((*step.result, step.expert_counts, step.prompt))  # one wait
        self.expert_load += counts
        return StepResult(*(a[:step.num_chunks] for a in sampled), counts, scores)

    @property
    def _sampler(self) -> Callable:
        return _invariant_sample if self.batch_invariant else sample

    def dispatch_decode(self, chunks: list[SeqChunk], token_ids: list[list[int]], rows: list[SampleRow],
                        steps: int, num_top: int = 0, images: list[RequestImages | None] | None = None,
                        previous: Dispatched | None = None) -> Dispatched:
        """``steps`` tokens per sequence in one device call (module docstring), with the logprobs of each and its
        top ``num_top``, not waited for (``fetch_decode`` brings them back): ``chunks`` are one token each
        (``count = 1``, ``start > 0``) with blocks for ``steps`` tokens; ``rows`` unconstrained. Not in
        batch-invariant mode. With ``previous`` (a step still on the device), ``token_ids`` may name its samples,
        as in ``dispatch``."""
        room = [len(c.block_table) * self.block_size - c.start for c in chunks]
        bad = [i for i, c in enumerate(chunks) if c.count != 1 or c.start < 1 or room[i] < steps]
        if bad:
            c = chunks[bad[0]]
            raise ValueError(f"decode: chunk {bad[0]} (start={c.start}, count={c.count}, room for {room[bad[0]]} "
                             f"tokens): expected one token after a cached context, with blocks for steps={steps}")
        if self.batch_invariant or any(r.matcher is not None for r in rows):
            raise ValueError("decode: a constrained row or a batch-invariant runner: expected neither (use run)")
        tokens, batch = self.prepare(chunks, token_ids, self.decode_tokens(len(chunks)), previous)
        num_seqs = batch.context_lens.shape[0]
        fed = self._fed(previous, num_seqs)
        last = np.zeros(num_seqs, np.int32)
        last[:len(chunks)] = np.arange(len(chunks))
        packed = self._packed(tokens, batch, last)
        mm = self._multimodal(images, chunks, len(tokens))
        with self.on_mesh():
            result, final, self.kv, counts = self.executables.call(
                "decode", _decode_steps, (self.params, self.kv), (packed, fed, sampling_batch(rows, num_seqs), mm),
                self._decode_static((len(tokens), num_seqs, batch.block_tables.shape[1]), steps, num_top,
                                    any(r.params.temperature > 0 for r in rows)))
        return Dispatched(result, counts, len(chunks), len(tokens), final)

    def fetch_decode(self, step: Dispatched) -> DecodeResult:
        """The host arrays of a dispatched multi-step decode (waits for it)."""
        result, counts = jax.device_get((step.result, step.expert_counts))
        self.expert_load += counts
        real = step.num_chunks
        return DecodeResult(result.tokens[:, :real].T, counts, result.logprobs[:, :real].T,
                            result.top_ids[:, :real].transpose(1, 0, 2),
                            result.top_logprobs[:, :real].transpose(1, 0, 2))

    # ----------------------------------------------------------------------- compiling ahead of serving

    def step_shapes(self, max_tokens: int, decode_only: bool = False) -> list[StepShape]:
        """Every shape ``prepare`` pads a step of at most ``max_tokens`` new tokens (at most ``max_seqs`` of them,
        ``decode_only``: one token per sequence, the decode steps' shapes, paged-only where kernels are traced) to:
        N runs over its buckets, S is N's, W is ``fixed_width`` or runs over its buckets up to ``max_blocks``
        (needs ``max_seqs`` and ``max_blocks``)."""
        if self.max_seqs is None or self.max_blocks is None:
            raise ValueError(f"step_shapes: a runner with max_seqs={self.max_seqs}, max_blocks={self.max_blocks} "
                             "pads S or W on its own: expected both")
        limit = min(max_tokens, self.max_seqs) if decode_only else max_tokens
        minimum = self.min_decode_tokens if decode_only else MIN_TOKENS_BUCKET
        widths = [self.fixed_width] if self.fixed_width else buckets(self.max_blocks, MIN_BLOCKS_BUCKET,
                                                                       BLOCKS_BUCKET_BASE)
        return [StepShape(n, self.num_seqs(n, 1), w, self._paged_only(decode_only))
                for n in buckets(limit, minimum) for w in widths]

    def _padding_packed(self, shape: StepShape) -> Any:
        """The packed inputs of a batch of ``shape`` holding padding only (every token's slot PAD)."""
        batch = make_batch([], self.block_size, num_tokens=shape.num_tokens, num_seqs=shape.num_seqs,
                           max_blocks=shape.max_blocks)
        return self._packed(np.zeros(shape.num_tokens, np.int32), batch, np.zeros(shape.num_seqs, np.int32))

    def _padding_call(self, shape: StepShape, scores: bool, fed: jax.Array | None = None) -> tuple[tuple, dict]:
        """``_step``'s arguments after the params and cache (and its static ones) for a step of ``shape`` over a
        batch of padding only (every token's slot PAD: running it leaves the cache as it was); with ``scores`` the
        scoring variant; ``fed``: its fed vector (default: a step's fed from the host)."""
        packed = self._padding_packed(shape)
        targets = self.place(np.zeros(shape.num_tokens, np.int32)) if scores else None
        fed = self._fed(None, shape.num_seqs) if fed is None else fed
        return (packed, fed, None, targets), self._step_static(shape[:3], shape.paged_only)

    def build_step(self, shape: StepShape, scores: bool = False) -> jax.ShapeDtypeStruct:
        """Compile ``run``'s forward step of ``shape`` (nothing runs; the one executable of that shape, whatever
        feeds its tokens), or with ``scores`` its scoring variant (``dispatch`` with targets), into the runner's
        ``executables``, where those calls find it; returns the logits it gives the sampler."""
        args, static = self._padding_call(shape, scores)
        with self.on_mesh():
            compiled = self.executables.build("step", _step, (self.params, self.kv), args, static, donate=(1,))
        info = compiled.out_info[0]
        return jax.ShapeDtypeStruct(info.shape, info.dtype,
                                    sharding=None if self.mesh is None else compiled.output_shardings[0])

    def run_padding(self, shape: StepShape, scores: bool = False, fed: jax.Array | None = None) -> jax.Array:
        """Run ``build_step``'s step of ``shape`` once over its batch of padding (the cache is left as it was), wait
        for it, and return its logits (as a step hands them to the sampler). A compiled executable's first run costs
        more than the next ones (XLA:CPU generates its kernels' code then; a GPU loads its modules), so warm-up runs
        each one once and the first requests do not pay it. ``fed``: one of ``padding_feds``."""
        args, static = self._padding_call(shape, scores, fed)
        with self.on_mesh():
            logits, self.kv, *rest = self.executables.call("step", _step, (self.params, self.kv), args, static)
        return jax.block_until_ready((logits, rest))[0]

    def _sample_call(self, logits: Any, num_top: int, draw: bool, masked: bool, biased: bool) -> tuple[tuple, dict]:
        """The sampler's arguments (and static ones) for ``logits`` ``[S, V]`` and rows of padding."""
        num_seqs = logits.shape[0]
        bitmask = np.zeros((num_seqs, -(-self.cfg.vocab // 32)), np.int32) if masked else None
        return ((logits, sampling_batch([], num_seqs, token_bitmask=bitmask, biased=biased)),
                self._sample_static(num_top, draw, num_seqs))

    def build_sample(self, logits: jax.ShapeDtypeStruct, num_top: int, draw: bool, masked: bool,
                     biased: bool = False) -> None:
        """Compile ``run``'s sampler for ``logits`` ``[S, V]`` (a ``build_step`` result), with ``num_top``
        logprobs, drawing or greedy, with a structured-output mask (``masked``) or without, with logit biases
        (``biased``) or without."""
        with self.on_mesh():
            self.executables.build("sample", _sample_fed, (), *self._sample_call(logits, num_top, draw, masked,
                                                                                  biased))

    def run_sample_padding(self, logits: jax.Array, num_top: int, draw: bool, masked: bool,
                           biased: bool = False) -> None:
        """Run ``build_sample``'s sampler once over ``logits`` (a ``run_padding`` step's: placed as a step's are, so
        this run's call signature is serving's) and rows of padding, and wait for it (its first run is the slow
        one, as ``run_padding``'s)."""
        with self.on_mesh():
            jax.block_until_ready(self.executables.call("sample", _sample_fed, (),
                                                        *self._sample_call(logits, num_top, draw, masked, biased)))

    def _decode_static(self, sizes: tuple[int, int, int], steps: int, num_top: int, draw: bool) -> dict[str, Any]:
        """``_decode_steps``' static arguments."""
        return dict(sizes=sizes, steps=steps, block_size=self.block_size, forward=self.forward, cfg=self.cfg,
                    kernels=self.kernels, draw=draw, num_top=num_top)

    def _decode_call(self, shape: StepShape, steps: int, num_top: int, draw: bool,
                     fed: jax.Array | None = None) -> tuple[tuple, dict]:
        """``_decode_steps``' arguments after the params and cache (and its static ones) for a batch of ``shape``
        of padding only (every token's slot PAD: running it leaves the cache as it was)."""
        packed = self._padding_packed(shape)
        fed = self._fed(None, shape.num_seqs) if fed is None else fed
        return ((packed, fed, sampling_batch([], shape.num_seqs), None),
                self._decode_static(shape[:3], steps, num_top, draw))

    def build_decode(self, shape: StepShape, steps: int, num_top: int, draw: bool) -> None:
        """Compile ``decode``'s ``steps``-token call for a decode batch of ``shape``."""
        with self.on_mesh():
            self.executables.build("decode", _decode_steps, (self.params, self.kv),
                                   *self._decode_call(shape, steps, num_top, draw), donate=(1,))

    def run_decode_padding(self, shape: StepShape, steps: int, num_top: int, draw: bool,
                           fed: jax.Array | None = None) -> None:
        """Run ``build_decode``'s call once over a batch of padding (the cache is left as it was), and wait for it
        (its first run is the slow one, as ``run_padding``'s). ``fed``: one of ``padding_feds``."""
        with self.on_mesh():
            result, _, self.kv, counts = self.executables.call("decode", _decode_steps, (self.params, self.kv),
                                                               *self._decode_call(shape, steps, num_top, draw, fed))
        jax.block_until_ready((result, counts))

    def _masks(self, rows: list[SampleRow], num_seqs: int) -> np.ndarray | None:
        """``[num_seqs, ceil(V / 32)]`` int32 allowed tokens of ``rows``, or None when no row is constrained (that
        step samples without a mask)."""
        matchers = [r.matcher for r in rows]
        if all(m is None for m in matchers):
            return None
        start = time.perf_counter()
        bitmask = fill_token_bitmask(matchers, self.cfg.vocab, num_seqs)
        self.mask_seconds += time.perf_counter() - start
        return bitmask
