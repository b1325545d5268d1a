"""``Engine``: add requests, step, stream outputs; ``generate`` runs a batch of prompts to completion.

Each ``step`` is one scheduler decision and one device call (``engine/runner.py``); outputs carry each sequence's new
token, its text delta (stop strings cut), and, when the sequence is done, why. A request with
``SamplingParams.n = k`` runs as k sequences (sample i seeded with seed + i).

With ``decode_steps = n > 1``, a step where every sequence decodes (no prefill chunk, no constrained row, no drafts;
not in batch-invariant mode) samples n tokens per sequence in its one device call where every
sequence has room for n (``Scheduler.reserve_ahead``; else a single step: one multi-step shape to compile;
``ModelRunner.dispatch_decode``), with their logprobs where asked for.
They are appended one by one, as n single steps would append them (stop conditions, streaming, block hashing), one
output each; those a sequence sampled after it finished are dropped.

Scheduling is asynchronous (``async_scheduling``, on by default): while a step runs on the device, the next one
is dispatched behind it, fed the tokens the first samples without their going through the host, and only then are
the first step's tokens fetched and appended (stop checks, streaming). So the host's work per step (fetching,
appending, detokenizing, preparing the next batch) hides behind the device's, and so it does when requests
arrive: the step dispatched ahead decodes every sequence the first samples for, goes on with the prompts it
prefills and admits waiting requests (``Scheduler.schedule_after``); with no prompt to run it is a multi-step
decode where every sequence has room for its tokens (``Scheduler.reserve_next``). It is not chained where a
sequence is constrained or penalized (its next token's mask or history needs the one before it on the host) or a
waiting one scores its prompt; the tokens a sequence samples after it finished are dropped. The tokens are those
of synchronous steps: each is sampled from the same batch row, seed and position.

Images (vision-language models; ``add_request(images=...)``): the prompt holds each image's placeholder tokens
(``images.expand_placeholders``); the first step that schedules a prefill chunk of such a request runs the image
encoder once over the images of every such request in the step (``ModelRunner.encode_images``), and the request
keeps the embeddings (on the device) for its later chunks and its n samples, until every sample is past its last
image token; a preempted request's recompute encodes them again where the cache lost the image's blocks. Placeholder
tokens are prompt tokens: the token budget and chunked prefill schedule them as any other. A full block holding
image tokens is named in the prefix cache by its tokens and its images' digests (``SequenceState.block_salt``).

Prompt logprobs (``SamplingParams.prompt_logprobs``, what an eval harness scores a text with): sample 0 of such a
request prefills its whole prompt, skipping the prefix cache (every position's logits are needed), each of its
prefill chunks in a step run as the runner's scoring variant (``ModelRunner.dispatch(targets=...)``): chunk token p
scores ``prompt[p + 1]``, so the chunks together score tokens 1 .. P - 1, each given all the tokens before it; the
entries come back in ``RequestResult.prompt_logprobs``. While a request is to score its prompt, steps draft nothing
(speculative decoding resumes after it); an engine whose drafter reads every step's hidden states refuses it.

Nothing need compile while serving: ``warm_up`` compiles every step shape the scheduler and runner can produce
(``ModelRunner.step_shapes``: N tokens and W block-table columns over their buckets, S a function of
N), each with the sampler variants a step may ask for, and the multi-step decodes, into the runner's
``executables`` (``engine/executables.py``), which the steps then call. With JAX's persistent compilation cache
(``use_compilation_cache``, on by default) each call is also kept exported in its folder (``EXPORTED``), so a
restart neither traces nor lowers the model: it reads the calls back and XLA's cache holds their executables.

Defaults follow the backend (``resolve_dtype``, ``default_decode_steps``): ``dtype="auto"`` serves bfloat16 on an
accelerator (the checkpoint's float16 where it is float16) and float32 on the CPU, where XLA's bfloat16 matmuls are
slower than float32 ones; a caller's own ``LoadedModel`` keeps its params' dtype.

Bookkeeping stays bounded: ``release`` hands back a finished request's result and forgets it (``generate`` does
so), ``abort`` drops an unfinished one and frees its cache blocks at once, and ``max_queue`` caps the
sequences that may wait beyond the ``max_running`` that run (``add_request`` raises ``EngineFullError``). A
step that raises fails only the requests it ran: they are aborted and ``StepError`` names them.
"""

import collections
import concurrent.futures
import contextvars
import dataclasses
import itertools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from apex_data import default_cache_dir
from serving import layers, sharding
from serving.config import ModelConfig
from serving.engine.blocks import BlockAllocator
from serving.engine.executables import Executables
from serving.engine.kv_tiers import KVTiers, TierStats, layout_fingerprint
from serving.engine.request import SequenceState as Seq
from serving.engine.runner import MIN_TOKENS_BUCKET, Dispatched, ModelRunner, bucket, from_previous
from serving.engine.sampler import SampleRow
from serving.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from serving.engine.scheduler import ScheduledChunk, Scheduler
from serving.images import ImageInput, ImageProcessorConfig, RequestImages, expand_placeholders
from serving.json_files import read_json
from serving.kv_cache import PagedKV, PagedLatentKV, SeqChunk
from serving.loaders import LoadedModel, load_model
from serving.models import model_module
from serving.quantization import is_quantized
from serving.spec_decode import (
    OFF,
    Drafter,
    DraftRequest,
    HiddenStateDrafter,
    NgramDrafter,
    Proposal,
    SpecConfig,
    SpecStats,
    SuffixDrafter,
    adaptive,
    grammar_drafts,
    merge_proposals,
)
from serving.spec_decode.step import VerifyChunk, compile_score, compile_verify, verify_step
from serving.structured import compile_constraint

SEED_RANGE = 2**32  # seeds are uint32
ABORT = "abort"  # finish reason of the samples ``Engine.abort`` stopped
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class DecodeSteps:
    """Tokens a multi-step decode samples per sequence in one device call: ``n``, or ``small_n`` where the decode
    batch is padded to at most ``small_batch`` sequences (0: ``n`` at every batch).

    A call of n steps takes the host a fixed t_h (dispatch, fetch, appending) beside the device's n * t_d, so a
    token costs t_d + t_h / n. The smaller the batch, the shorter t_d and the more t_h / n weighs: small batches
    take more steps per call. Each decode shape still runs one n, so the compiled set is the same size."""

    n: int
    small_n: int = 0
    small_batch: int = 0

    def __post_init__(self):
        if self.n < 1 or self.small_n < 0 or self.small_batch < 0:
            raise ValueError(f"{self}: expected n >= 1 (1: one token per step), small_n and small_batch >= 0")

    def at(self, padded_batch: int) -> int:
        """Steps per call for a decode batch padded to ``padded_batch`` sequences."""
        return self.small_n if self.small_n and padded_batch <= self.small_batch else self.n


# DecodeSteps by jax.default_backend() (others: 1). On a GPU several steps per call save the host's time between
# steps, and batches of up to 8 sequences (the smallest decode shape), whose steps are shortest, take 16. On the CPU
# the host is the device, and SmolLM2 decodes no faster.
DECODE_STEPS = {"cpu": DecodeSteps(1), "gpu": DecodeSteps(8, small_n=16, small_batch=8)}
COMPILATION_CACHE = "jax-compilation"  # the persistent compilation cache's folder, in the project's cache folder
EXPORTED = "exported"  # the folder of warm-up's exported calls, in the compilation cache's (engine.executables)


class EngineFullError(RuntimeError):
    """``add_request`` would exceed ``max_running + max_queue`` unfinished sequences: retry later."""


class StepError(RuntimeError):
    """A step raised; ``request_ids`` are the requests it ran, which have been aborted (the cause is chained)."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"step failed for requests {request_ids}: {type(cause).__name__}: {cause}")
        self.request_ids = request_ids
Prompt = Sequence[int] | str | Sequence[Mapping[str, Any]]  # token ids, text, or chat messages


@dataclasses.dataclass
class StepOutput:
    """What one step produced for one sequence."""

    request_id: str
    index: int  # which of the request's n samples
    token_id: int
    text: str  # new text (may be "" while a character or a possible stop string is incomplete)
    finished: bool
    finish_reason: str | None  # "stop" | "length" once finished, "error" if its output constraint failed
    logprobs: dict | None  # {"logprob": chosen, "top": [(id, logprob), ...]} when requested
    error: str | None = None  # why, when finish_reason is "error" (the request's other samples are aborted)


@dataclasses.dataclass
class Completion:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "error" (its output constraint failed: ``error`` says how)
    logprobs: list[dict] | None
    error: str | None = None


@dataclasses.dataclass
class RequestResult:
    request_id: str
    prompt_ids: list[int]
    outputs: list[Completion]  # one per sample, by index
    num_cached_tokens: int  # prompt tokens the prefix cache supplied (first sample, last admission)
    # with SamplingParams.prompt_logprobs: per prompt token, {"logprob", "top"} given the tokens before it (the
    # first None: no context)
    prompt_logprobs: list[dict | None] | None = None


class InFlight(NamedTuple):
    """A step (``steps`` 1) or multi-step decode on the device whose tokens the host has not appended yet: its
    ``chunks`` (chunk i's sampled tokens are row i of its result; a multi-step decode's chunks count its
    ``steps``)."""

    chunks: list[ScheduledChunk]
    step: Dispatched
    steps: int = 1


class TokenLogprobs:
    """A step's sampled tokens' logprobs ``[R, T]`` and top alternatives ``[R, T, K]`` (row r, its token t) as the
    entries ``{"logprob", "top"}`` that outputs carry; chunk i reads row ``rows[i]`` (default i). The arrays become
    host lists once, at the first entry asked for, since indexing numpy arrays token by token costs host time per
    token that a batch's many tokens per step multiply."""

    def __init__(self, logprobs: np.ndarray, top_ids: np.ndarray, top_logprobs: np.ndarray,
                 rows: Sequence[int] | None = None):
        self._arrays, self._lists, self.rows = (logprobs, top_ids, top_logprobs), None, rows

    def entry(self, i: int, j: int, num_top: int) -> dict:
        """Chunk i's token j, with its top ``num_top`` alternatives."""
        if self._lists is None:
            self._lists = tuple(a.tolist() for a in self._arrays)
        row = i if self.rows is None else self.rows[i]
        logprobs, top_ids, top_logprobs = (a[row][j] for a in self._lists)
        return {"logprob": logprobs, "top": list(zip(top_ids[:num_top], top_logprobs[:num_top], strict=True))}


def _sample_row(seq: Seq, ahead: int = 0) -> SampleRow:
    """What the sampler needs of a sequence for its next token; ``ahead``: tokens already sampled on the device
    and not appended yet (a chained step's), which its position counts."""
    return SampleRow(seq.params, seq.seed, len(seq.output_ids) + ahead, seq.prompt_ids, seq.output_ids, seq.matcher)


def _prompt_targets(chunks: Sequence[ScheduledChunk]) -> list[list[int]] | None:
    """The targets of a step that scores prompts (``ModelRunner.dispatch``): chunk token p's is ``prompt[p + 1]``
    where its sequence scores its prompt and p + 1 is a prompt position (0 elsewhere, unread); None when no chunk
    has one."""
    targets = []
    for c in chunks:
        scored = c.seq.prompt_ids[c.start + 1:c.start + c.count + 1] if c.seq.scores_prompt else []
        targets.append(scored + [0] * (c.count - len(scored)))
    return targets if any(c.seq.scores_prompt and c.start + 1 < len(c.seq.prompt_ids) for c in chunks) else None


def _record_prompt_logprobs(chunks: Sequence[ScheduledChunk], scores: Any) -> None:
    """Keep the entries ``{"logprob", "top"}`` (top ``params.prompt_logprobs``) of the prompt tokens the step
    scored (``_prompt_targets``'s; ``scores``: ``StepResult.prompt``) on their sequences."""
    logprobs, top_ids, top_logprobs = scores.logprobs.tolist(), scores.top_ids.tolist(), scores.top_logprobs.tolist()
    first = 0
    for c in chunks:
        seq = c.seq
        if seq.scores_prompt:
            k = seq.params.prompt_logprobs
            for p in range(c.start, min(c.start + c.count, len(seq.prompt_ids) - 1)):
                t = first + p - c.start
                seq.prompt_logprobs[p + 1] = {"logprob": logprobs[t],
                                              "top": list(zip(top_ids[t][:k], top_logprobs[t][:k], strict=True))}
        first += c.count


def create_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: jnp.dtype,
                 mesh: Mesh | None = None) -> Any:
    """The model's paged cache: latent pages for MLA (DeepSeek), separate k/v pages otherwise; on ``mesh`` split
    by ``sharding.cache_spec``, each device's part made in place (the whole cache never sits on one device)."""
    kind = PagedLatentKV if cfg.is_mla else PagedKV
    if mesh is None:
        return kind.create(cfg, num_blocks, block_size, dtype)
    return jax.jit(lambda: kind.create(cfg, num_blocks, block_size, dtype),
                   out_shardings=NamedSharding(mesh, sharding.cache_spec(cfg)))()


def resolve_dtype(dtype: str | jnp.dtype, model: str | Path | LoadedModel | None) -> jnp.dtype:
    """The params and cache dtype ``dtype`` names for ``model``: a dtype (or its name in ``DTYPES``) as given;
    "auto": a ``LoadedModel``'s params' floating dtype (the most common among its plain arrays: quantized weights'
    codes and scales say nothing of it), else float32 on the CPU, else the checkpoint's float16 if its config.json
    says so, else bfloat16."""
    if isinstance(dtype, str) and dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: expected 'auto' or one of {list(DTYPES)}")
        return jnp.dtype(DTYPES[dtype])
    if not isinstance(dtype, str):
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"dtype={dtype!r}: expected a floating dtype or 'auto'")
        return jnp.dtype(dtype)
    if isinstance(model, LoadedModel):
        floats = [leaf.dtype for leaf in jax.tree.leaves(model.params, is_leaf=is_quantized)
                  if not is_quantized(leaf) and jnp.issubdtype(leaf.dtype, jnp.floating)]
        return collections.Counter(floats).most_common(1)[0][0] if floats else jnp.dtype(jnp.float32)
    if jax.default_backend() == "cpu":
        return jnp.dtype(jnp.float32)
    config = Path(model) / "config.json" if model is not None else None
    if config is not None and config.is_file():
        hf = read_json(config)
        if (hf.get("torch_dtype") or hf.get("dtype")) == "float16":
            return jnp.dtype(jnp.float16)
    return jnp.dtype(jnp.bfloat16)


def default_decode_steps() -> DecodeSteps:
    """``DECODE_STEPS`` of this process's default backend (one step per call where it names none)."""
    return DECODE_STEPS.get(jax.default_backend(), DecodeSteps(1))


def use_compilation_cache(folder: str | Path | bool = True) -> Path | None:
    """Turn on JAX's persistent compilation cache (process-wide) in ``folder`` (True: ``COMPILATION_CACHE`` in the
    project's cache folder, ``$APEX_JAX_CACHE`` or ``~/.cache/apex-jax``), every compile kept however short, so a
    restart compiles nothing; False: leave the setting as it is. A folder the process set already
    (``jax_compilation_cache_dir``) is kept. Returns the folder in use, or None."""
    if folder is False:
        return None
    if current := jax.config.jax_compilation_cache_dir:
        return Path(current)
    path = default_cache_dir() / COMPILATION_CACHE if folder is True else Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def _tiers(kv: Any, cfg: ModelConfig, params: Any, dtype: jnp.dtype, block_size: int, host_blocks: int,
           host_gb: float | None, disk_dir: str | Path | None, disk_blocks: int | None) -> KVTiers | None:
    """The engine's ``KVTiers`` (``Engine``'s host_cache_* and disk_cache_* arguments), or None without tiers."""
    if host_gb is not None:
        if host_blocks:
            raise ValueError(f"Engine: host_cache_blocks={host_blocks} and host_cache_gb={host_gb}: expected one")
        if host_gb < 0:
            raise ValueError(f"Engine: host_cache_gb={host_gb}: expected >= 0")
        block_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(kv)) // jax.tree.leaves(kv)[0].shape[0]
        host_blocks = int(host_gb * 2**30 // block_bytes)
        if host_gb > 0 and host_blocks == 0:
            raise ValueError(f"Engine: host_cache_gb={host_gb} holds no block of {block_bytes} bytes")
    if host_blocks < 0:
        raise ValueError(f"Engine: host_cache_blocks={host_blocks}: expected >= 0 (0: no host tier)")
    if not host_blocks:
        if disk_dir is not None:
            raise ValueError(f"Engine: disk_cache_dir={str(disk_dir)!r} without a host tier: expected "
                             "host_cache_blocks or host_cache_gb > 0 (the disk tier sits under the host tier)")
        return None
    fingerprint = layout_fingerprint(cfg, params, dtype, block_size) if disk_dir is not None else ""
    return KVTiers(kv, host_blocks, disk_dir, fingerprint, disk_blocks)


class Engine:
    """A continuous-batching engine over one model.

    Args:
      model: a GGUF file, a HF checkpoint folder, None for the embedded SmolLM2-135M-Instruct, or a
        ``LoadedModel`` built by the caller.
      dtype: params and cache dtype, or "auto" (``resolve_dtype``: bfloat16 on an accelerator, float32 on the
        CPU, a ``LoadedModel``'s own).
      num_blocks, block_size: the paged cache (num_blocks * block_size tokens in all).
      max_running: the most sequences in one step; token_budget: the most new tokens in one step;
        prefill_chunk: the prefill tokens running sequences take per step while others wait to be admitted
        (``Scheduler``; default token_budget // 2).
      max_model_len: context length (default: the model's max_position), at most the cache's
        num_blocks * block_size tokens: a sequence the cache cannot hold whole could never finish.
      max_queue: the most sequences waiting beyond ``max_running`` (None: no limit).
      speculative: draft tokens and verify them in one pass (``serving.spec_decode``); acceptance counters in
        ``spec_stats``. Outputs are unchanged (greedy: identical; sampled: the same distribution). A step where no
        sequence got drafts (none found, the request's ``SamplingParams.speculative`` is "off", or the adaptive
        policy chose none) is a plain step, multi-step and dispatched ahead as without speculation; with a drafter
        that reads the target's hidden states (``HiddenStateDrafter``) every step is a verification.
      batch_invariant: every step through ``serving.batch_invariant`` (fixed-geometry Pallas kernels, in Pallas'
        interpreter off a GPU): a sequence's logits are bitwise the same alone or in any batch and chunking.
        Plain bf16/fp32 weights on one device; verification passes too (greedy drafted tokens are the plain ones).
      mesh: a ``sharding.make_mesh`` mesh to run on (None: one device): params split by the model's
        ``param_specs``, the cache by ``sharding.cache_spec``, steps under ``jax.set_mesh`` (the MoE layers
        expert-parallel). The same tokens as on one device, with ``speculative`` too (drafts and verification on
        the mesh: a block drafter's arrays replicated, a draft model's split as the target's); not with
        ``batch_invariant``.
      decode_steps: the most tokens a decode-only step samples per sequence in one device call (module
        docstring): an int at every batch (1: one per step), a ``DecodeSteps`` by batch, or None:
        ``default_decode_steps()``, by backend. The same tokens as single steps; other steps (prefill,
        constrained, verification), and every step with ``batch_invariant``, sample one.
      compilation_cache: JAX's persistent compilation cache folder (``use_compilation_cache``; True: the default
        folder, False: not turned on by the engine).
      async_scheduling: dispatch the next decode step before fetching the tokens of the one running (module
        docstring); False: every step waits for its tokens.
      eager_admission: after a step in which a sequence finished, while a running slot is free, the decode
        dispatched ahead is a single step instead of a multi-step call. A request that arrives meanwhile (over
        HTTP, a closed-loop client's next turn comes right after its last answer) then waits for one short step
        before its prefill, not for a whole ``decode_steps`` call; the price is one more device call per finish.
        Off by default (the README's serving figures say where it stands).
      host_cache_blocks, host_cache_gb: the prefix cache's host-memory tier (``kv_tiers``), in blocks or GiB (one
        of the two; 0 / None: no tiers): full blocks the GPU evicts are kept there and loaded back on a prefix hit.
      disk_cache_dir: the disk tier's folder under the host tier (None: none); a new engine of the same model over
        the same folder reuses its blocks. disk_cache_blocks: the most blocks on disk (None: no bound).
      kernels: which implementation each layer runs (``layers.KernelPolicy``; default: the fastest measured on the
        device); replaced by ``layers.BATCH_INVARIANT`` with ``batch_invariant``.
    """

    def __init__(self, model: str | Path | LoadedModel | None = None, dtype: str | jnp.dtype = "auto",
                 num_blocks: int = 256, block_size: int = 16, max_running: int = 32, token_budget: int = 256,
                 max_model_len: int | None = None, max_queue: int | None = None,
                 speculative: SpecConfig | None = None, batch_invariant: bool = False, mesh: Mesh | None = None,
                 decode_steps: int | DecodeSteps | None = None, prefill_chunk: int | None = None,
                 compilation_cache: str | Path | bool = True, async_scheduling: bool = True,
                 eager_admission: bool = False,
                 host_cache_blocks: int = 0, host_cache_gb: float | None = None,
                 disk_cache_dir: str | Path | None = None, disk_cache_blocks: int | None = None,
                 kernels: layers.KernelPolicy = layers.DEFAULT):
        if max_queue is not None and max_queue < 0:
            raise ValueError(f"Engine: max_queue={max_queue}: expected None (no limit) or >= 0")
        if decode_steps is None:
            decode_steps = default_decode_steps()
        elif not isinstance(decode_steps, DecodeSteps):
            if isinstance(decode_steps, bool) or not isinstance(decode_steps, int):
                raise TypeError(f"Engine: decode_steps={decode_steps!r}: expected an int, a DecodeSteps or None")
            if decode_steps < 1:
                raise ValueError(f"Engine: decode_steps={decode_steps}: expected >= 1 (1: one token per step)")
            decode_steps = DecodeSteps(decode_steps)
        if mesh is not None and batch_invariant:
            raise ValueError(f"Engine: a mesh {dict(mesh.shape)} with batch_invariant=True: expected one device "
                             "(mesh=None) for it")
        self.compilation_cache = use_compilation_cache(compilation_cache)
        dtype = resolve_dtype(dtype, model)
        loaded = model if isinstance(model, LoadedModel) else load_model(model, dtype)
        self.cfg, params, self.tokenizer, self.eos_ids = loaded[:4]
        # How the front end cuts an image into patches: the checkpoint's settings, else the encoder's defaults.
        self.image_processor = loaded.image_processor or (ImageProcessorConfig.for_vision(self.cfg.vision)
                                                          if self.cfg.vision else None)
        if mesh is not None:
            sharding.check_mesh(mesh, self.cfg)
            params = sharding.shard_params(params, model_module(self.cfg.family).param_specs(self.cfg), mesh)
        else:  # the runner's layout (it would relayout too), here before the cache takes the memory the copy needs
            params = layers.kernel_layout(params, layers.BATCH_INVARIANT if batch_invariant else kernels)
        self.max_queue, self.dtype, self.decode_steps = max_queue, dtype, decode_steps
        kv = create_cache(self.cfg, num_blocks, block_size, dtype, mesh)
        self.tiers = _tiers(kv, self.cfg, params, dtype, block_size, host_cache_blocks, host_cache_gb,
                            disk_cache_dir, disk_cache_blocks)
        self.allocator = BlockAllocator(num_blocks, block_size, self.tiers)
        self.scheduler = Scheduler(self.allocator, max_running, token_budget, prefill_chunk)
        self.max_model_len = min(self.cfg.max_position, max_model_len or self.cfg.max_position,
                                 self.scheduler.capacity)
        module = model_module(self.cfg.family)
        self.runner = ModelRunner(self.cfg, params, module.forward, kv, block_size, batch_invariant=batch_invariant,
                                  mesh=mesh, max_seqs=max_running, kernels=kernels,
                                  encode=getattr(module, "encode_images", None),
                                  max_blocks=-(-self.max_model_len // block_size),
                                  score_tokens=bucket(self.scheduler.token_budget, MIN_TOKENS_BUCKET))
        self.runner.tiers = self.tiers
        if self.compilation_cache is not None and mesh is None:  # warm_up's calls kept exported beside XLA's cache
            self.runner.executables = Executables(self.compilation_cache / EXPORTED, salt=jax.devices()[0].device_kind)
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng()
        self._requests: dict[str, tuple[list[int], list[Seq]]] = {}
        self.speculative = speculative
        self.drafters: dict[str, Drafter] = speculative.build_all(self.cfg, params) if speculative else {}
        self.drafter = self.drafters[speculative.name] if speculative else None  # the default drafter
        self.spec_policy = speculative.policy() if speculative else None
        self._measure: tuple[str, int, int] | None = None  # this step's kind, size and tokens per sequence
        self.spec_stats = SpecStats()
        self.async_scheduling, self.eager_admission = async_scheduling, eager_admission
        self._freed = False  # a sequence finished since the last step dispatched ahead (eager_admission)
        self._inflight: InFlight | None = None
        self.chained_wait_s: float | None = None  # the last step's wait for the call it found in flight (_advance)
        self._ahead: list[ScheduledChunk] = []  # the chunks of the step being dispatched ahead (``_chain``)

    @property
    def tier_stats(self) -> TierStats | None:
        """The prefix-cache tiers' counters (``kv_tiers.TierStats``), None without tiers."""
        return None if self.tiers is None else self.tiers.stats

    def reset_prefix_cache(self) -> None:
        """Forget every block the GPU prefix cache names (a fresh allocator over the same pages, with the engine's
        ``tiers``, whose contents stay): the next requests start cold on the GPU. RuntimeError unless idle."""
        if self.has_unfinished():
            raise RuntimeError("reset_prefix_cache: the engine has unfinished requests: expected an idle engine")
        self.allocator = self.scheduler.allocator = BlockAllocator(self.allocator.num_blocks, self.allocator.block_size,
                                                                   self.tiers)

    def persist_cache(self) -> int:
        """Copy every block the GPU prefix cache names to the tiers and wait for the copies (written through to
        the disk tier), so a new engine over the same ``disk_cache_dir`` finds them; returns the blocks named.
        ValueError without tiers."""
        if self.tiers is None:
            raise ValueError("persist_cache: this engine has no cache tiers (host_cache_blocks=0)")
        named = self.allocator.registered()
        for block, block_hash in named:
            self.tiers.save(block, block_hash)
        with self.runner.on_mesh():
            self.runner.kv = self.tiers.apply(self.runner.kv)
        self.tiers.drain()
        return len(named)

    @classmethod
    def from_default(cls, **kwargs: Any) -> "Engine":
        """The engine over the embedded SmolLM2-135M-Instruct."""
        return cls(None, **kwargs)

    def warm_up(self, progress: Callable[[int, int], None] | None = None) -> list[tuple]:
        """Compile every device call a step can make (nothing runs), so that serving meets no new shape:

        * the forward step of every ``ModelRunner.step_shapes`` shape (N up to ``token_budget``, W up to
          ``max_model_len``'s blocks, S = N's), the scoring variant (a step that scores a prompt,
          ``SamplingParams.prompt_logprobs``) at the shapes of its one N (``ModelRunner.score_tokens``), and for
          each S the sampler with and without logprobs, greedy and drawing, with and without logit biases, and
          (with a tokenizer, which constraints need) with and without a structured-output mask;
        * the decode step, at every decode-only shape (N up to ``max_running`` and ``token_budget``). Every step is
          one executable whatever feeds its tokens, the host or the step before on the device
          (``ModelRunner.dispatch(previous=...)``), so a step chained behind another is compiled too;
        * every multi-step decode: each decode-only shape of N sequences where n = ``decode_steps.at(N)`` > 1
          (the only n a multi-step decode of that shape runs; fewer tokens left run single steps), with and without
          logprobs, greedy and drawing.

        With a model-free drafter (n-gram, suffix) a step is a verification where anything was drafted, else plain:
        both sets, the verification's being its scoring forward at each shape (paged-only or not) and its
        verification variants; a model drafter's steps are not in the set (nothing is compiled), nor are penalized
        requests' verifications (their token histories have widths of their own). With cache tiers, their copies
        run once at every batch size, with no effect (``KVTiers.warm_up``). Parallel threads trace, lower and
        compile them; ``progress(done, total)`` is called after each. Then, on an accelerator, every forward step,
        sampler and multi-step decode runs once over padding (its first run is the slow one, loading its modules
        and recording its CUDA graphs: ``ModelRunner.run_padding``, ``run_sample_padding``,
        ``run_decode_padding``); on a CPU only the decode steps do, as running every prefill shape costs more
        start-up time than the first requests save, while a decode step's first run is short and slows every
        answer's first tokens.
        Returns what was compiled: ("step" | "scores" | "score", StepShape), ("sample", S, num_top, draw,
        masked, biased), ("verify", S, num_top, draw, masked) and ("decode", StepShape, n, num_top, draw) entries."""
        if self.has_unfinished():
            raise RuntimeError("warm_up: the engine has unfinished requests: expected an idle engine")
        runner = self.runner
        shapes = runner.step_shapes(self.scheduler.token_budget)
        top_draw = list(itertools.product((0, MAX_LOGPROBS), (False, True)))
        masked = (False, True) if self.tokenizer is not None else (False,)
        samplers = [(num_top, draw, m) for (num_top, draw), m in itertools.product(top_draw, masked)]
        decode_shapes = runner.step_shapes(self.scheduler.token_budget, decode_only=True)
        if self.drafter is not None and not isinstance(self.drafter, NgramDrafter | SuffixDrafter):
            return []  # a model drafter's own calls are not in the set
        plain = not runner.batch_invariant
        decodes = [("step", shape) for shape in decode_shapes if shape not in shapes] if plain else []
        if plain:
            decodes += [("decode", shape, n, *v) for shape in decode_shapes
                        if (n := self.decode_steps.at(shape.num_tokens)) > 1 for v in top_draw]
        num_seqs = sorted({shape.num_seqs for shape in shapes})
        # each sampler's logits [S * rows, V]: what the first forward of its kind gives, at each S
        first = {"step": runner.build_step(shapes[0])}
        logits = {"sample": {n: jax.ShapeDtypeStruct((n, *first["step"].shape[1:]), first["step"].dtype,
                                                     sharding=first["step"].sharding) for n in num_seqs}}
        entries = ([("step", shape) for shape in shapes]
                   + [("scores", shape) for shape in shapes if shape.num_tokens == runner.score_tokens]
                   + [("sample", n, *v, biased) for n in num_seqs for v in samplers for biased in (False, True)])
        if self.drafter is not None:  # a step with drafts is a verification: its scoring forward and verifier too
            rows = self.speculative.k + 1
            scores = sorted({shape._replace(paged_only=p) for shape in shapes for p in (False, True)})
            first["score"] = compile_score(runner, scores[0], self.speculative.k)
            logits["verify"] = {n: jax.ShapeDtypeStruct((n * rows, *first["score"].shape[1:]), first["score"].dtype,
                                                        sharding=first["score"].sharding) for n in num_seqs}
            entries += [("score", shape) for shape in scores] + [("verify", n, *v) for n in num_seqs for v in samplers]
        entries += decodes
        compiled = {("step", shapes[0])} | ({("score", scores[0])} if self.drafter is not None else set())
        build_entry = {"step": runner.build_step, "decode": runner.build_decode,
                       "scores": lambda shape: runner.build_step(shape, scores=True),
                       "sample": lambda n, *variant: runner.build_sample(logits["sample"][n], *variant),
                       "score": lambda shape: compile_score(runner, shape, self.speculative.k),
                       "verify": lambda n, *v: compile_verify(runner, logits["verify"][n], self.speculative.k, *v)}
        if progress is not None:
            progress(len(compiled), len(entries))
        if self.tiers is not None:
            with runner.on_mesh():
                runner.kv = self.tiers.warm_up(runner.kv)
        # Each thread traces, lowers and compiles its entries (XLA compiles in parallel, lowering partly). A Mosaic
        # GPU kernel's lowered module names itself by how many kernels of its name the process lowered before
        # (``mosaic_gpu.dump_basename``), so a threaded lowering's modules differ start to start; a restart that
        # reads the calls back from the runner's exported folder compiles the very bytes the first start wrote, so
        # XLA's cache keys hold whatever the order.
        with concurrent.futures.ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
            futures = [pool.submit(contextvars.copy_context().run, build_entry[kind], *args)
                       for kind, *args in entries if (kind, *args) not in compiled]
            for done, future in enumerate(concurrent.futures.as_completed(futures), start=len(compiled) + 1):
                future.result()
                if progress is not None:
                    progress(done, len(entries))
        # each call's first run, over padding (ModelRunner.run_padding and the like); on a CPU the decode steps' only
        step_logits = {}  # S -> the logits of a step of S sequences: what the sampler of S runs on
        # every kind of fed vector on an accelerator; a CPU's start-up runs one (a slow path there costs a few ms)
        feds = runner.padding_feds if runner.platform != "cpu" else (lambda num_seqs: [None])
        for kind, *args in entries:
            if kind == "scores" and (runner.platform != "cpu" or args[0] in decode_shapes):
                runner.run_padding(args[0], scores=True)
            elif kind == "step" and (runner.platform != "cpu" or args[0] in decode_shapes):
                for fed in feds(args[0].num_seqs):  # fed from the host, and chained
                    step_logits.setdefault(args[0].num_seqs, runner.run_padding(args[0], fed=fed))
            elif kind == "sample" and runner.platform != "cpu":
                runner.run_sample_padding(step_logits[args[0]], *args[1:])
            elif kind == "decode" and runner.platform != "cpu":
                for fed in feds(args[0].num_seqs):
                    runner.run_decode_padding(*args, fed=fed)
        return entries

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of ``prompt``: ids as given, text encoded, chat messages rendered by the chat template."""
        if isinstance(prompt, str) or (len(prompt) > 0 and isinstance(prompt[0], Mapping)):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass the prompt as token ids")
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt)
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(prompt), add_special_tokens=False)
        ids = [int(t) for t in prompt]
        if not ids or not all(0 <= t < self.cfg.vocab for t in ids):
            raise ValueError(f"prompt ids must be a non-empty list in [0, {self.cfg.vocab}), got {ids[:8]}...")
        return ids

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    cache_salt: str | None = None, images: Sequence[ImageInput] = ()) -> str:
        """Queue a request; returns its id. Its samples end with "length" at ``max_model_len`` tokens if
        max_tokens does not stop them first; a prompt of ``max_model_len`` tokens or more -> ValueError.
        ``images``: preprocessed images (``images.preprocess``), in the order the prompt holds their placeholder
        runs, or one placeholder each (as the chat template writes them; expanded here). ValueError for a model
        without an image encoder, or a prompt holding neither."""
        params = params or SamplingParams()
        if images and self.cfg.vision is None:
            raise ValueError(f"this model ({self.cfg.family}) has no vision encoder: it reads text only, expected no "
                             "images")
        if images and self.drafter is not None:
            raise ValueError("speculative decoding does not take images: expected a request without images")
        if params.prompt_logprobs is not None and self._observes():
            raise ValueError(f"SamplingParams.prompt_logprobs = {params.prompt_logprobs} on an engine whose drafter "
                             f"({self.speculative.name}) verifies every step: expected prompt_logprobs=None")
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.max_queue is not None:
            limit = self.scheduler.max_running + self.max_queue
            if params.n > limit:
                raise ValueError(f"SamplingParams.n = {params.n}: expected <= max_running + max_queue = {limit}")
            unfinished = len(self.scheduler.waiting) + len(self.scheduler.running)
            if unfinished + params.n > limit:
                raise EngineFullError(f"{unfinished} sequences are unfinished and {params.n} more would exceed "
                                      f"max_running + max_queue = {limit}")
        if params.speculative not in (None, OFF) and params.speculative not in self.drafters:
            raise ValueError(f"SamplingParams.speculative = {params.speculative!r}: expected None, {OFF!r} or one "
                             f"of this engine's drafters {sorted(self.drafters)}"
                             + ("" if self.drafters else " (none: Engine(speculative=...) offers them)"))
        ids = self.encode(prompt)
        placed = None
        if images:
            if ids.count(self.cfg.vision.image_token_id) == len(images):  # one placeholder each: the chat template's
                ids = expand_placeholders(ids, images, self.cfg.vision)
            placed = RequestImages.place(ids, images, self.cfg.vision)
        constraint = None
        if params.constraint is not None:  # compiled before queueing: an invalid one raises InvalidConstraintError
            if self.tokenizer is None:
                raise ValueError("SamplingParams.constraint needs a tokenizer; this model has none")
            constraint = compile_constraint(params.constraint, self.tokenizer, self.cfg.vocab)
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(SEED_RANGE))
        seqs = [Seq(next(self._ids), request_id, i, list(ids), params, (seed + i) % SEED_RANGE, self.eos_ids,
                    self.max_model_len, self.tokenizer.decode_stream() if self.tokenizer else None, cache_salt,
                    matcher=constraint.matcher() if constraint else None, images=placed,
                    prompt_logprobs=[None] * len(ids) if params.prompt_logprobs is not None and i == 0 else None)
                for i in range(params.n)]
        for seq in seqs:
            self.scheduler.add(seq)
        self._requests[request_id] = (ids, seqs)
        return request_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def in_flight_kind(self) -> tuple[int, int] | None:
        """(device steps, padded tokens per step) of the call in flight (``async_scheduling``: dispatched, its tokens
        not appended yet; a multi-step decode's steps are ``decode_steps``), None when none is: calls of one kind
        take about one time."""
        inflight = self._inflight
        return None if inflight is None else (inflight.steps, inflight.step.num_tokens)

    @property
    def can_admit(self) -> bool:
        """Whether a request added now could run in the next step: fewer than ``max_running`` sequences run or
        wait."""
        scheduler = self.scheduler
        return len(scheduler.running) + len(scheduler.waiting) < scheduler.max_running

    @property
    def num_requests(self) -> int:
        """Requests the engine holds: unfinished ones and finished ones not yet released."""
        return len(self._requests)

    def abort(self, request_id: str) -> bool:
        """Stop request ``request_id`` now: its unfinished samples end with finish reason "abort", their cache
        blocks are freed, and the request is forgotten. False if the engine does not hold it."""
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return False
        for seq in entry[1]:
            if not seq.finished:
                self.scheduler.abort(seq)
                seq.finish_reason = ABORT
                self._forget(seq)
        return True

    def release(self, request_id: str) -> RequestResult:
        """The result of a finished request, which the engine then forgets (so finished requests do not pile up)."""
        result = self.result(request_id)
        unfinished = [c.index for c in result.outputs if c.finish_reason is None]
        if unfinished:
            raise ValueError(f"release({request_id!r}): samples {unfinished} are unfinished: abort it instead")
        del self._requests[request_id]
        return result

    def step(self) -> list[StepOutput]:
        """Run one scheduled step; one output per sequence that sampled a token. With a decode step in flight
        (``async_scheduling``), the step after it is dispatched first, then its tokens are the outputs.

        If the step raises, the requests it ran are aborted (the others keep their place) and ``StepError``
        names them; a cache the failed device call consumed is rebuilt (``_reset_cache``).
        """
        start, traced, self._measure = time.perf_counter(), adaptive.traces(), None
        self.chained_wait_s = None
        outputs = self._step()
        if self.spec_policy is not None and self._measure is not None and adaptive.traces() == traced:
            kind, size, per_step = self._measure  # the policy learns the time of a step that compiled nothing
            self.spec_policy.observe(kind, size, (time.perf_counter() - start) / per_step, per_step)
        return outputs

    def _step(self) -> list[StepOutput]:
        if self._inflight is not None:
            inflight = self._inflight
            outputs = self._guarded([c.seq for c in inflight.chunks], lambda: self._advance(inflight))
            if outputs or self._inflight is not None:
                return outputs  # else every sequence it ran had finished: schedule afresh
        drafted = self._propose() if self.drafters and not self._scoring() else None
        chunks = self.scheduler.schedule()
        if not chunks:
            return []

        def run() -> list[StepOutput]:
            self._encode_images(chunks)
            if drafted is not None:
                return self._run_speculative(chunks, *drafted)
            multi = self._multi_step(chunks)
            return self._run(chunks) if multi is None else self._run_multi_step(multi)

        return self._guarded([c.seq for c in chunks], run)

    def _guarded(self, seqs: list[Seq], run: Callable[[], list[StepOutput]]) -> list[StepOutput]:
        """``run()``; if it raises, the requests of ``seqs`` and of the step it was dispatching ahead (those it
        admitted among them) are aborted, nothing stays in flight, a consumed cache is rebuilt, and ``StepError``
        names the requests."""
        self._ahead = []
        try:
            return run()
        except Exception as e:
            self._inflight = None
            request_ids = list(dict.fromkeys(s.request_id for s in [*seqs, *(c.seq for c in self._ahead)]))
            for request_id in request_ids:
                self.abort(request_id)
            if any(leaf.is_deleted() for leaf in jax.tree.leaves(self.runner.kv)):
                self._reset_cache()
            raise StepError(request_ids, e) from e

    def _reset_cache(self) -> None:
        """A fresh cache and allocator (the old prefix cache named blocks that are gone); every running sequence
        goes back to the queue, to be recomputed."""
        self._inflight = None
        for seq in reversed(list(self.scheduler.running)):
            self.scheduler.running.remove(seq)
            seq.block_table, seq.block_hashes, seq.num_computed = [], [], 0
            self.scheduler.waiting.insert(0, seq)
        if self.tiers is not None:
            self.tiers.reset()
        self.allocator = self.scheduler.allocator = BlockAllocator(self.allocator.num_blocks, self.allocator.block_size,
                                                                   self.tiers)
        self.runner.kv = create_cache(self.cfg, self.allocator.num_blocks, self.allocator.block_size, self.dtype,
                                      self.runner.mesh)

    def _encode_images(self, chunks: list[ScheduledChunk]) -> None:
        """Encode, in one call, the images of every request in ``chunks`` not encoded yet whose chunk starts before
        its last image token (a chunk past them, or a prompt whose image blocks the prefix cache holds, needs none)."""
        pending = list({id(c.seq.images): c.seq.images for c in chunks
                        if c.seq.images is not None and not c.seq.images.encoded
                        and c.start < c.seq.images.end}.values())
        if pending:
            self.runner.encode_images(pending)

    def _release_images(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Drop the encoder's outputs of each request in ``chunks`` whose every sequence is past its last image token
        (this chunk's end, or its cache): the steps already dispatched hold what they read, and a recompute after
        preemption encodes the images afresh. Until then they hold device memory the cache's plan does not count."""
        for c in chunks:
            images = c.seq.images
            if images is None or not images.encoded or c.start + c.count < images.end:
                continue
            _, seqs = self._requests.get(c.seq.request_id, ((), ()))
            if all(s is c.seq or s.num_computed >= images.end for s in seqs):
                images.embeds = images.deepstack = None

    def _images(self, seqs: Sequence[Seq]) -> list[RequestImages | None] | None:
        """The step's per-chunk images for the runner, None when no sequence has any."""
        images = [s.images for s in seqs]
        return None if all(i is None for i in images) else images

    def _run(self, chunks: list) -> list[StepOutput]:
        seqs = [c.seq for c in chunks]
        rows = [_sample_row(s) for s in seqs]
        wants_top = any(c.samples and c.seq.params.logprobs for c in chunks)
        targets = _prompt_targets(chunks)
        step = self.runner.dispatch([SeqChunk(c.seq.block_table, c.start, c.count) for c in chunks],
                                    [c.seq.tokens[c.start:c.start + c.count] for c in chunks],
                                    rows, MAX_LOGPROBS if wants_top else 0, images=self._images(seqs),
                                    targets=targets)
        self._release_images(chunks)
        if all(c.count == 1 and c.samples and c.start > 0 for c in chunks):
            self._measure = ("decode", len(chunks), 1)
        if self.async_scheduling and not self.runner.batch_invariant and targets is None:
            self._inflight = self._chain(InFlight(chunks, step))
        result = self.runner.fetch(step)
        if targets is not None:
            _record_prompt_logprobs(chunks, result.prompt)
        return self._appended(chunks, list(range(len(chunks))), result)

    def _appended(self, chunks: list[ScheduledChunk], rows: list[int], result: Any) -> list[StepOutput]:
        """``_outputs`` of one token per chunk: chunk i's is row ``rows[i]`` of the step's ``result``."""
        tokens = result.tokens.tolist()
        table = TokenLogprobs(result.logprobs[:, None], result.top_ids[:, None], result.top_logprobs[:, None], rows)
        return self._outputs(chunks, [[tokens[row]] for row in rows], table)

    def _chain(self, inflight: InFlight) -> InFlight | None:
        """Dispatch the step after ``inflight`` while it is on the device, before its tokens are known: each
        sequence it samples for and that has room for more decodes, fed its token on the device (``from_previous``
        of its row), and prompts go on from where it leaves them; waiting sequences are admitted
        (``Scheduler.schedule_after``). With no prompt to run, that is a decode of ``decode_steps`` tokens where
        every sequence has room for them (a multi-step decode), else of one. None (the next step is scheduled once
        its tokens are appended) where a sequence runs that ``inflight`` does not hold, a sampling one is
        constrained or penalized (its next token's mask or history needs the one before it on the host), a waiting
        one scores its prompt, blocks are not free, nothing is left to run, or the next step should draft
        (``_drafts_next``)."""
        k, chunks = inflight.steps, inflight.chunks
        freed, self._freed = self._freed, False
        running = {s.seq_id for s in self.scheduler.running}
        if len(running) > len(chunks) or not running <= {c.seq.seq_id for c in chunks}:
            return None
        decoding, prefilling, rows = [], [], {}
        for row, c in enumerate(chunks):
            seq = c.seq
            if seq.seq_id not in running:
                continue
            if not c.samples:
                prefilling.append((seq, c.start + c.count))
            elif seq.matcher is not None or seq.params.uses_penalties:
                return None
            elif self._left(seq) > k:  # else that step samples its last token
                decoding.append((seq, c.start + c.count))
                rows[seq.seq_id] = row
        waiting = self.scheduler.waiting
        if any(s.scores_prompt for s in waiting) or self._drafts_next([s for s, _ in decoding]):
            return None
        seqs = [s for s, _ in decoding]
        if not prefilling and not (waiting and len(self.scheduler.running) < self.scheduler.max_running):
            if not decoding:
                return None
            # a sequence whose max_tokens comes first stops within the n tokens (the rest are dropped, as after a
            # stop token); only the context must hold them all
            n = self._steps(len(seqs))
            n = n if n > 1 and all(s.max_len - s.num_tokens >= k + n and not s.params.logit_bias for s in seqs) else 1
            if self.eager_admission and freed and len(self.scheduler.running) < self.scheduler.max_running:
                n = 1  # a slot was just freed: a request arriving meanwhile joins the call after a short one
            if not self.scheduler.reserve_next(seqs, [p - s.num_computed for s, p in decoding], n):
                return None
            next_chunks = [ScheduledChunk(s, p, n, True) for s, p in decoding]
        else:
            next_chunks = self.scheduler.schedule_after(decoding, prefilling)
            if not next_chunks:
                return None
            n = 1
            self._ahead = next_chunks
            self._encode_images(next_chunks)
        token_ids = [[from_previous(rows[c.seq.seq_id])] if c.seq.seq_id in rows
                     else c.seq.tokens[c.start:c.start + c.count] for c in next_chunks]
        sample_rows = [_sample_row(c.seq, k if c.seq.seq_id in rows else 0) for c in next_chunks]
        num_top = MAX_LOGPROBS if any(c.samples and c.seq.params.logprobs for c in next_chunks) else 0
        seq_chunks = [SeqChunk(c.seq.block_table, c.start, 1 if n > 1 else c.count) for c in next_chunks]
        images = self._images([c.seq for c in next_chunks])
        if n > 1:
            step = self.runner.dispatch_decode(seq_chunks, token_ids, sample_rows, n, num_top, images=images,
                                               previous=inflight.step)
        else:
            step = self.runner.dispatch(seq_chunks, token_ids, sample_rows, num_top, previous=inflight.step,
                                        images=images)
        self._release_images(next_chunks)
        return InFlight(next_chunks, step, n)

    @staticmethod
    def _left(seq: Seq) -> int:
        """The tokens ``seq`` may still sample: up to its max_tokens and its max_len."""
        return min(seq.params.max_tokens - len(seq.output_ids), seq.max_len - seq.num_tokens)

    def _advance(self, inflight: InFlight) -> list[StepOutput]:
        """Chain the step after ``inflight``, then fetch and append ``inflight``'s tokens (those of sequences that
        finished or were aborted meanwhile dropped)."""
        self._inflight = self._chain(inflight)
        running = {s.seq_id for s in self.scheduler.running}
        rows = [i for i, c in enumerate(inflight.chunks) if c.seq.seq_id in running]
        chunks = [inflight.chunks[i] for i in rows]
        for c in chunks:
            if c.seq.num_computed != c.start:
                raise RuntimeError(f"sequence {c.seq.seq_id} is at {c.seq.num_computed}: expected {c.start}, where "
                                   "its step in flight computes")
        if all(c.count == inflight.steps and c.samples and c.start > 0 for c in inflight.chunks):
            self._measure = ("decode", len(inflight.chunks), inflight.steps)
        fetch, outputs = ((self.runner.fetch, self._appended) if inflight.steps == 1 else
                          (self.runner.fetch_decode, self._decoded))
        fetch_start = time.perf_counter()
        result = fetch(inflight.step)
        self.chained_wait_s = time.perf_counter() - fetch_start
        return outputs(chunks, rows, result)

    def _steps(self, num_seqs: int) -> int:
        """Steps per call of a multi-step decode of ``num_seqs`` sequences (``DecodeSteps.at`` its padded batch)."""
        return self.decode_steps.at(self.runner.decode_tokens(num_seqs))

    def _multi_step(self, chunks: list) -> list | None:
        """``chunks`` as the n-token chunks of a multi-step decode (``Scheduler.reserve_ahead``), or None where this
        step samples one token per sequence: ``decode_steps`` 1, batch-invariant mode, a chunk that is not one token
        after a cached context, a constrained or logit-biased row (whose sampler variants ``warm_up`` compiles for
        single steps only), or no room for n > 1."""
        n = self._steps(len(chunks))
        if n == 1 or self.runner.batch_invariant or not all(
                c.count == 1 and c.samples and c.start > 0 and c.seq.matcher is None and not c.seq.params.logit_bias
                for c in chunks):
            return None
        chunks = self.scheduler.reserve_ahead(chunks, n, exact=True)
        return chunks if chunks[0].count > 1 else None

    def _run_multi_step(self, chunks: list) -> list[StepOutput]:
        """One device call samples ``count`` tokens per chunk (``ModelRunner.dispatch_decode``), and with
        ``async_scheduling`` the next such call is dispatched behind it (``_chain``); one output per token kept."""
        seqs, steps = [c.seq for c in chunks], chunks[0].count
        step = self.runner.dispatch_decode(
            [SeqChunk(s.block_table, c.start, 1) for s, c in zip(seqs, chunks, strict=True)],
            [s.tokens[c.start:c.start + 1] for s, c in zip(seqs, chunks, strict=True)], [_sample_row(s) for s in seqs],
            steps, MAX_LOGPROBS if any(s.params.logprobs for s in seqs) else 0, images=self._images(seqs))
        self._release_images(chunks)
        self._measure = ("decode", len(chunks), steps)
        if self.async_scheduling:
            self._inflight = self._chain(InFlight(chunks, step, steps))
        return self._decoded(chunks, list(range(len(chunks))), self.runner.fetch_decode(step))

    def _decoded(self, chunks: list[ScheduledChunk], rows: list[int], result: Any) -> list[StepOutput]:
        """``_outputs`` of a multi-step decode's tokens: chunk i's are row ``rows[i]`` of ``result``."""
        tokens = result.tokens.tolist()
        return self._outputs(chunks, [tokens[row] for row in rows],
                             TokenLogprobs(result.logprobs, result.top_ids, result.top_logprobs, rows))

    def _outputs(self, chunks: list, tokens: list[list[int]],
                 logprobs: TokenLogprobs | None = None) -> list[StepOutput]:
        """``scheduler.update(chunks, tokens)`` (chunk i's tokens in order, those past a stop dropped): one output per
        appended token, the last of a finished sequence carrying its finish reason; ``logprobs``: the entries of
        chunk i's tokens, for the sequences that ask for logprobs."""
        chunk_of = {c.seq.seq_id: i for i, c in enumerate(chunks)} if logprobs is not None else {}
        ahead = {} if self._inflight is None else {c.seq.seq_id: c.count for c in self._inflight.chunks}
        outputs = []
        for seq, texts in self.scheduler.update(chunks, tokens, ahead):
            if not texts:
                continue
            request_id, index, num_top = seq.request_id, seq.index, seq.params.logprobs
            first, last = len(seq.output_ids) - len(texts), len(texts) - 1
            for j, text in enumerate(texts):
                entry = None
                if logprobs is not None and num_top is not None:
                    entry = logprobs.entry(chunk_of[seq.seq_id], j, num_top)
                    seq.logprobs.append(entry)
                if j < last:
                    outputs.append(StepOutput(request_id, index, seq.output_ids[first + j], text, False, None, entry))
                else:
                    outputs.append(StepOutput(request_id, index, seq.output_ids[first + j], text, seq.finished,
                                              seq.finish_reason, entry, seq.error))
            if seq.finished:
                self._forget(seq, learn=True)
                self._freed = True
        return outputs

    def _forget(self, seq: Seq, learn: bool = False) -> None:
        """Release a finished or aborted sequence from the drafters and the policy; a finished one's output goes
        to the suffix drafter's global store (``learn``)."""
        for drafter in self.drafters.values():
            if learn and isinstance(drafter, SuffixDrafter):
                drafter.learn(seq.output_ids)
            drafter.release(seq.seq_id)
        if self.spec_policy is not None:
            self.spec_policy.release(seq.seq_id)

    def _drafter_name(self, seq: Seq) -> str | None:
        """The drafter ``seq`` asks for (``SamplingParams.speculative``; None: the engine's own), None for "off"."""
        name = seq.params.speculative
        return None if name == OFF else name or self.speculative.name

    def _room(self, seq: Seq) -> int:
        """The drafts ``seq`` may take: at most k, never past its max_tokens or the context length."""
        return max(0, min(self.speculative.k, seq.params.max_tokens - len(seq.output_ids) - 1,
                          seq.max_len - seq.num_tokens - 1))

    def _scoring(self) -> bool:
        """Whether a sequence is to score its prompt: steps are then plain ones (no drafts), whose scoring variant
        computes every position's logprobs (``_run``)."""
        return any(s.scores_prompt for s in itertools.chain(self.scheduler.running, self.scheduler.waiting))

    def _observes(self) -> bool:
        """Whether the engine's drafter reads every verification pass's hidden states (``HiddenStateDrafter``):
        every step is then a verification, drafted or not (a plain step would leave it blind)."""
        return isinstance(self.drafter, HiddenStateDrafter)

    def _drafts_next(self, seqs: list[Seq]) -> bool:
        """Whether the step after the one in flight (``seqs`` decoding) should be a verification step: some sequence
        has a drafter and the policy (if adaptive) would draft for it, or a drafter observes every pass."""
        names = [self._drafter_name(s) for s in seqs] if self.drafters else []
        if not any(n is not None for n in names):
            return False
        if self._observes() or self.spec_policy is None:
            return True
        limits = [0 if n is None else self._room(s) for s, n in zip(seqs, names, strict=True)]
        return any(self.spec_policy.choose([s.seq_id for s in seqs], limits, self._steps(len(seqs)))[0])

    def _propose(self) -> tuple[list[Seq], Proposal, dict[int, int]] | None:
        """Drafts for every running sequence that is decoding (``draft_ids``) from its drafter, at most
        ``_room`` or the adaptive policy's length; a constrained sequence's end where its grammar rejects one
        (``grammar_drafts``). Returns the decoding sequences, the drafters' merged proposal and each drafted
        sequence's row in it; None (no drafts) where nothing was drafted or the policy finds the drafts not worth
        a verification pass, unless a drafter observes every pass (``_observes``)."""
        decoding = [s for s in self.scheduler.running if s.num_tokens - s.num_computed == 1]
        names = [self._drafter_name(s) for s in decoding]
        limits = [0 if n is None else self._room(s) for s, n in zip(decoding, names, strict=True)]
        seq_ids = [s.seq_id for s in decoding]
        if self.spec_policy is not None:
            limits = self.spec_policy.plan(seq_ids, limits, self._steps(len(seq_ids)))
        proposals, order = [], []
        for name in dict.fromkeys(n for n, limit in zip(names, limits, strict=True) if n is not None and limit):
            group = [i for i, (n, limit) in enumerate(zip(names, limits, strict=True)) if n == name and limit]
            with self.runner.on_mesh():  # a drafter on the target's arrays works on its mesh
                proposals.append(self.drafters[name].propose(
                    [DraftRequest(decoding[i].seq_id, decoding[i].tokens, len(decoding[i].output_ids),
                                  decoding[i].params, decoding[i].seed, limits[i]) for i in group],
                    self.speculative.k))
            order += group
        proposal = merge_proposals(proposals, self.speculative.k, self.cfg.vocab) if proposals else Proposal([])
        rows = {}
        for row, (i, drafts) in enumerate(zip(order, proposal.tokens, strict=True)):
            seq = decoding[i]
            rows[seq.seq_id], seq.draft_ids = row, list(drafts[:limits[i]])
            if seq.matcher is not None:
                one_hot = proposal.probs is None or seq.params.temperature == 0
                seq.draft_ids = grammar_drafts(seq.draft_ids, seq.matcher, one_hot)
        lengths = [len(s.draft_ids) for s in decoding]
        if not self._observes() and not (any(lengths) and (
                self.spec_policy is None or self.spec_policy.worth(seq_ids, lengths, self._steps(len(seq_ids))))):
            for seq in decoding:
                seq.draft_ids = []
            return None
        return decoding, proposal, rows

    def _run_speculative(self, chunks: list, drafted: list[Seq], proposal: Proposal,
                         proposal_rows: dict[int, int]) -> list[StepOutput]:
        """One target forward over every chunk (decoding ones with their drafts), verification, and one output
        per appended token."""
        verify_chunks = []
        for c in chunks:
            s = c.seq
            drafts = s.draft_ids[:max(0, c.start + c.count - s.num_tokens)]
            verify_chunks.append(VerifyChunk(SeqChunk(s.block_table, c.start, c.count),
                                             s.tokens[c.start:c.start + c.count - len(drafts)] + drafts,
                                             _sample_row(s),
                                             drafts, proposal_rows.get(s.seq_id, 0), s.seq_id))
        for seq in drafted:
            seq.draft_ids = []
        wants_top = any(c.samples and c.seq.params.logprobs for c in chunks)
        result = verify_step(self.runner, verify_chunks, self.speculative.k, proposal.probs,
                             MAX_LOGPROBS if wants_top else 0, self.drafter)
        self._measure = ("verify", sum(c.count for c in chunks), 1)
        accepted = [result.tokens[i, :result.num_accepted[i] + 1].tolist() for i in range(len(chunks))]
        for c, v, n in zip(chunks, verify_chunks, result.num_accepted.tolist(), strict=True):
            if c.samples and v.drafts:
                self.spec_stats.num_steps += 1
                self.spec_stats.num_draft_tokens += len(v.drafts)
                self.spec_stats.num_accepted_tokens += n
                if self.spec_policy is not None:
                    self.spec_policy.update(c.seq.seq_id, len(v.drafts), n)
        return self._outputs(chunks, accepted, TokenLogprobs(result.logprobs, result.top_ids, result.top_logprobs))

    def result(self, request_id: str) -> RequestResult:
        """The request's outputs so far (complete once every sample finished)."""
        ids, seqs = self._requests[request_id]
        outputs = [Completion(s.index, list(s.output_ids), s.text, s.finish_reason,
                              s.logprobs if s.params.logprobs is not None else None, s.error) for s in seqs]
        return RequestResult(request_id, ids, outputs, seqs[0].num_cached_tokens, seqs[0].prompt_logprobs)

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestResult]:
        """Run ``prompts`` (with one params for all, or one each) to completion; results in prompt order."""
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"generate: {len(params_list)} SamplingParams for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        while any(not s.finished for i in ids for s in self._requests[i][1]):
            self.step()
        return [self.release(i) for i in ids]
