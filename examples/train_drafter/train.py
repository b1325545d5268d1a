"""Train a block drafter (``serving.spec_decode.block_model``) on the target's own outputs, with apex_jax's AdamW.

    python -m examples.train_drafter --out DIR          # SmolLM2-135M-Instruct, GPU defaults
    python -m examples.train_drafter --out DIR --cpu    # a tiny CPU run that proves the pipeline

1. data: chat prompts (``prompts.py``), the target's greedy answers (held-out prompts through the
   ``Engine``; training prompts ``gen_batch`` at a time in one fixed-shape device loop each, ``answers``, for
   ``gen_seconds``: a greedy round over all of them, then rounds sampled at ``gen_temperature`` for more
   contexts like the target's own (the labels stay the target's distribution), so a faster machine collects
   more), then ONE
   teacher-forced pass of the target over each prompt + answer for its hidden states after the drafter's
   ``target_layers`` (``[T, F, D]``, as a verification pass hands them to ``BlockDrafter``).
2. training: B anchors ``a`` drawn from the answer tokens per step; the drafter (its layers start as copies of
   the target's top ones) sees the states at ``a - W .. a - 1`` and ``x_a`` and predicts ``x_{a+1} .. x_{a+k}``;
   loss ``sum_j w_j CE_j / sum_j w_j`` with ``w_j = decay^(j-1)`` (a draft position counts only if every one before
   it is accepted, so the early ones matter most). ``CE_j`` is against the target's whole distribution at that
   position (self-distillation: ``softmax`` of the target's logits, recomputed from its stored final-layer
   states at ``a .. a + k - 1``; far more signal per example than its greedy token) or, with
   ``soft_labels=False``, against the greedy token. A share ``truncate_prob`` of contexts lose the states of their
   prompt's full cache blocks: a prompt met again comes from the prefix cache (all its full blocks; a chat
   template's shared system prompt, for every prompt), and ``BlockDrafter`` has no states for what it did not run.
   ``apexw`` (bf16 moments) after global-norm clipping; the learning rate is warmed up, then cosine-decayed over the
   run's progress ``max(step / steps, elapsed / train_seconds)``: a slow machine ends the same schedule early
   instead of overrunning ``time_budget``.
3. evaluation on held-out prompts (never trained on): the acceptance length teacher-forced
   (``1 + E[drafts equal to the target's greedy tokens before the first miss]``) and through the engine with
   speculation (``SpecStats.mean_acceptance_length``), whose outputs are compared with the plain greedy answers.
4. ``--out``: the checkpoint (``block_model.save``) and ``metrics.json``.

``serve --speculative block --drafter DIR`` serves the checkpoint.
"""

import argparse
import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from apex_jax import apexw
from examples.train_drafter.prompts import chat_prompts
from serving import layers
from serving.config import ModelConfig
from serving.engine.runner import ModelRunner
from serving.engine.sampler import SampleRow
from serving.engine.sampling_params import SamplingParams
from serving.kv_cache import AttentionBatch, PagedKV, SeqChunk
from serving.llm_engine import DTYPES, Engine, Prompt
from serving.models import llama, model_module
from serving.spec_decode import BlockDrafter, SpecConfig, block_model
from serving.spec_decode.block_model import BlockDrafterConfig

BLOCK_SIZE = 16  # KV cache block of the engines and the teacher-forced pass
CLIP_NORM = 1.0  # global gradient norm clip
LOG_EVERY = 500  # steps between progress lines
SYNC_EVERY = 10  # steps the host may dispatch ahead of the device
# Tokens per generation step: the decodes of max_running sequences plus a few new prompts' prefill. Small, so
# that steps fall into few padded shapes (each one compiles the whole model once).
GENERATION_TOKEN_BUDGET = 1024
MAX_SEQS_PER_PASS = 256  # sequences packed into one teacher-forced pass at most
MIN_TRAIN_SHARE = 0.1  # of the time budget, for training however long the data took
FINAL_LR_SHARE = 0.1  # the cosine schedule ends at this share of the peak learning rate

PAGED_ONLY = layers.KernelPolicy(paged_only=True)  # decode tokens only: the paged kernel for every token


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One run. The defaults are the GPU recipe for SmolLM2-135M-Instruct (one H200, within ``time_budget``)."""

    max_prompts: int = 100_000  # training prompts at most (all of prompts.py's but the held-out ones)
    num_eval_prompts: int = 64  # held-out prompts
    max_tokens: int = 192  # answer length
    gen_seconds: float = 100.0  # training prompts are answered for this long
    block: int = 8  # k: tokens drafted per pass
    window: int = 64  # W: positions whose target hidden states the drafter reads
    layers: int = 2
    steps: int = 100_000  # at most; the time budget usually ends training first
    batch: int = 512  # anchors per step
    lr: float = 1e-3
    warmup: int = 300  # steps
    weight_decay: float = 0.01
    decay: float = 0.8  # loss weight of draft position j: decay^(j-1)
    truncate_prob: float = 0.5  # share of training contexts whose prompt came from the prefix cache (docstring)
    soft_labels: bool = True  # distill the target's distribution (module docstring); False: its greedy tokens
    dtype: str = "float32"  # the target's dtype (generation, hidden states)
    compute_dtype: str = "bfloat16"  # the drafter's training compute and the stored hidden states
    gen_batch: int = 512  # training prompts answered together (``answers``)
    gen_temperature: float = 0.8  # answers after the first (greedy) round over the prompts are sampled (0: none)
    max_train_tokens: int = 6_000_000  # no further round once the data holds this many (its states: ~3.5 KB each)
    tokens_per_pass: int = 16384  # teacher-forced pass: tokens per forward
    eval_concurrency: int = 16  # the engine's max_running in the online evaluation
    time_budget: float = 420.0  # seconds for the whole run; training gets what data and evaluation leave
    eval_seconds: float = 120.0  # what training leaves for the evaluation (an engine's compiles, its decoding)
    seed: int = 0

    def __post_init__(self):
        for name in ("dtype", "compute_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"TrainConfig.{name} = {getattr(self, name)!r}: expected one of {list(DTYPES)}")
        for name in ("max_prompts", "num_eval_prompts", "max_tokens", "steps", "batch", "gen_batch",
                     "max_train_tokens", "tokens_per_pass", "eval_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} = {getattr(self, name)!r}: expected >= 1")
        if not 0 < self.decay <= 1:
            raise ValueError(f"TrainConfig.decay = {self.decay!r}: expected in (0, 1]")
        if self.gen_temperature < 0:
            raise ValueError(f"TrainConfig.gen_temperature = {self.gen_temperature!r}: expected >= 0")
        if not 0 <= self.truncate_prob <= 1:
            raise ValueError(f"TrainConfig.truncate_prob = {self.truncate_prob!r}: expected in [0, 1]")


CPU_CONFIG = TrainConfig(max_prompts=24, num_eval_prompts=4, max_tokens=32, block=4, window=16, layers=1, steps=60,
                         batch=16, lr=2e-3, warmup=10, compute_dtype="float32", gen_batch=8, tokens_per_pass=1024,
                         eval_concurrency=4, time_budget=240.0, eval_seconds=60.0, gen_temperature=0.0)


# --------------------------------------------------------------------------- data


class TargetData(NamedTuple):
    """Sequences (prompt + the target's answer) back to back, with the target's hidden states (device arrays)."""

    tokens: jax.Array  # [T] int32
    hidden: jax.Array  # [T, F, D] the target's hidden states after the drafter's target_layers
    starts: jax.Array  # [T] int32 flat index where each token's sequence starts
    ends: jax.Array  # [T] int32 flat index where it ends (exclusive)
    computed: jax.Array  # [T] int32 flat index of its first state when its prompt's full blocks come from a cache
    anchors: jax.Array  # [A] int32 flat indices of answer tokens with a token after them


def generate(engine: Engine, prompts: Sequence[Prompt], max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy answer ids) of every prompt through ``engine``."""
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [(r.prompt_ids, r.outputs[0].token_ids) for r in results]


@functools.partial(jax.jit, static_argnames=("forward", "cfg", "steps", "temperature"), donate_argnames="kv")
def _decode_loop(params: dict, kv: Any, first: jax.Array, positions: jax.Array, tables: jax.Array, key: jax.Array, *,
                 forward: Callable, cfg: ModelConfig, steps: int, temperature: float) -> tuple[jax.Array, Any]:
    """``steps`` decode steps of B sequences in one device loop: ``first [B]`` is each one's newest token, at
    ``positions [B]``, its cache blocks ``tables [B, blocks]``; returns the tokens after it ``[B, steps]``, the
    argmax (``temperature`` 0) or drawn from ``softmax(logits / temperature)`` with ``key``."""
    rows = jnp.arange(first.shape[0], dtype=jnp.int32)
    block_size = kv.k[0].shape[1]

    def step(i, carry):
        kv, token, out = carry
        pos = positions + i
        slots = tables[rows, pos // block_size] * block_size + pos % block_size
        # every token a sequence of its own that reads its keys from the pages (kv_lens = context = pos + 1)
        batch = AttentionBatch(pos, rows, slots, tables, pos + 1, pos + 1, jnp.arange(rows.size + 1, dtype=jnp.int32))
        # decode tokens only: every token through the paged kernel, no packed flash attention
        logits, kv, _ = forward(params, cfg, token, batch, kv, kernels=PAGED_ONLY)
        token = (jnp.argmax(logits, axis=-1) if temperature == 0 else
                 jax.random.categorical(jax.random.fold_in(key, i), logits / temperature)).astype(jnp.int32)
        return kv, token, out.at[:, i].set(token)

    out = jnp.zeros((first.shape[0], steps), jnp.int32)
    kv, _, out = jax.lax.fori_loop(0, steps, step, (kv, first, out))
    return out, kv


def answers(cfg: ModelConfig, params: dict, prompts: Sequence[list[int]], max_tokens: int, eos_ids: Sequence[int],
            wave: int, seconds: float = math.inf, temperature: float = 0.0,
            seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) of the prompts, ``wave`` at a time, until ``seconds`` have passed: every wave is one
    packed prefill and ``max_tokens - 1`` decode steps in one device loop (fixed shapes: two compiles, no host
    work per token), each answer cut after its first eos (kept, as the engine keeps it). Greedy (``temperature``
    0) answers are the engine's up to floating-point ties (a different batch shape rounds differently)."""
    forward = model_module(cfg.family).forward
    longest = max(map(len, prompts))
    blocks = -(-(longest + max_tokens) // BLOCK_SIZE)
    runner = ModelRunner(cfg, params, forward, PagedKV.create(cfg, wave * blocks, BLOCK_SIZE, params["embed"].dtype),
                         BLOCK_SIZE)
    tables = np.arange(wave * blocks, dtype=np.int32).reshape(wave, blocks)
    sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens)
    eos, start, pairs = np.asarray(list(eos_ids)), time.perf_counter(), []
    for w in range(0, len(prompts), wave):
        if time.perf_counter() - start > seconds:
            break
        group = [list(p) for p in prompts[w:w + wave]]
        group += [group[0]] * (wave - len(group))  # a short last wave repeats a prompt (one shape)
        chunks = [SeqChunk(list(t), 0, len(p)) for t, p in zip(tables, group, strict=True)]
        first = runner.run(chunks, group, [SampleRow(sampling, seed + w + i, 0, (), ()) for i in range(wave)]).tokens
        lengths = np.array([len(p) for p in group], np.int32)
        rest, runner.kv = _decode_loop(params, runner.kv, first, lengths, tables, jax.random.key(seed + w),
                                       forward=forward, cfg=cfg, steps=max_tokens - 1, temperature=temperature)
        for prompt, answer in zip(prompts[w:w + wave], np.concatenate([first[:, None], np.asarray(rest)], 1),
                                  strict=False):
            stops = np.flatnonzero(np.isin(answer, eos))
            pairs.append((list(prompt), answer[:stops[0] + 1 if stops.size else max_tokens].tolist()))
    return pairs


@functools.partial(jax.jit, static_argnames=("forward", "cfg", "layers"), donate_argnames="kv")
def _hidden_pass(params: dict, kv: Any, tokens: jax.Array, batch: Any, *, forward: Callable, cfg: ModelConfig,
                 layers: tuple[int, ...]) -> tuple[jax.Array, Any]:
    _, kv, _, hidden = forward(params, cfg, tokens, batch, kv, hidden_layers=layers)
    return hidden, kv


def hidden_states(cfg: ModelConfig, params: dict, sequences: Sequence[Sequence[int]], layers: tuple[int, ...],
                  tokens_per_pass: int, dtype: jnp.dtype) -> jax.Array:
    """The target's hidden states after ``layers`` ``[sum of lengths, F, D]`` (in ``dtype``) of every sequence,
    teacher-forced: sequences are packed into prefill passes of about ``tokens_per_pass`` tokens over a scratch
    paged cache."""
    longest = max(len(s) for s in sequences)
    blocks = -(-max(tokens_per_pass, longest) // BLOCK_SIZE) + MAX_SEQS_PER_PASS  # + each one's last block's rest
    runner = ModelRunner(cfg, params, model_module(cfg.family).forward,
                         PagedKV.create(cfg, blocks, BLOCK_SIZE, params["embed"].dtype), BLOCK_SIZE)
    out, group = [], []

    def run(group: list[Sequence[int]]) -> None:
        chunks, first = [], 0
        for s in group:
            n = -(-len(s) // BLOCK_SIZE)
            chunks.append(SeqChunk(list(range(first, first + n)), 0, len(s)))
            first += n
        tokens, batch = runner.prepare(chunks, [list(s) for s in group])
        hidden, runner.kv = _hidden_pass(params, runner.kv, tokens, batch, forward=runner.forward, cfg=cfg,
                                         layers=layers)
        out.append(hidden[:sum(len(s) for s in group)].astype(dtype))

    for s in sequences:
        if group and (sum(map(len, group)) + len(s) > tokens_per_pass or len(group) == MAX_SEQS_PER_PASS):
            run(group)
            group = []
        group.append(s)
    run(group)
    return jnp.concatenate(out)


def target_data(cfg: ModelConfig, params: dict, pairs: Sequence[tuple[list[int], list[int]]],
                layers: tuple[int, ...], tokens_per_pass: int, dtype: jnp.dtype) -> TargetData:
    """``TargetData`` of (prompt, answer) pairs; anchors are the answer tokens but the last of each."""
    sequences = [p + a for p, a in pairs]
    lengths = np.array([len(s) for s in sequences])
    ends = np.cumsum(lengths)
    starts = ends - lengths
    anchors = np.concatenate([np.arange(s + len(p), e - 1) for (p, _), s, e in zip(pairs, starts, ends, strict=True)])
    cached = np.array([(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p, _ in pairs])  # the scheduler keeps >= 1 token
    return TargetData(jnp.asarray(np.concatenate(sequences), jnp.int32),
                      hidden_states(cfg, params, sequences, layers, tokens_per_pass, dtype),
                      jnp.asarray(np.repeat(starts, lengths), jnp.int32),
                      jnp.asarray(np.repeat(ends, lengths), jnp.int32),
                      jnp.asarray(np.repeat(starts + cached, lengths), jnp.int32), jnp.asarray(anchors, jnp.int32))


class Batch(NamedTuple):
    ctx_hidden: jax.Array  # [B, W, F, D] the target's states at a - W .. a - 1
    newest: jax.Array  # [B] x_a
    ctx_positions: jax.Array  # [B, W] t - a
    ctx_valid: jax.Array  # [B, W]
    computed_from: jax.Array  # [B] t - a of the first state left when the prompt's full blocks are cached
    labels: jax.Array  # [B, k] x_{a+1} .. x_{a+k}
    label_valid: jax.Array  # [B, k] within the sequence
    label_hidden: jax.Array  # [B, k, D] the target's final-layer states that predict the labels (at a .. a+k-1)


def gather(data: TargetData, anchors: jax.Array, cfg: BlockDrafterConfig) -> Batch:
    """The drafter's inputs and labels at flat anchor indices ``anchors [B]`` (as ``BlockDrafter`` sees them)."""
    last = data.tokens.shape[0] - 1
    t = anchors[:, None] - cfg.window + jnp.arange(cfg.window)[None]  # [B, W] context positions
    targets = anchors[:, None] + 1 + jnp.arange(cfg.block)[None]  # [B, k]
    return Batch(data.hidden[jnp.maximum(t, 0)], data.tokens[anchors], t - anchors[:, None],
                 t >= data.starts[anchors][:, None], data.computed[anchors] - anchors,
                 data.tokens[jnp.minimum(targets, last)],
                 targets < data.ends[anchors][:, None], data.hidden[jnp.minimum(targets - 1, last), -1])


def truncate_context(batch: Batch, key: jax.Array, prob: float) -> Batch:
    """With probability ``prob`` per anchor, hide the states of the prompt's full blocks, as a prefix-cache hit
    leaves the context (module docstring)."""
    cached = jax.random.bernoulli(key, prob, (batch.newest.shape[0], 1))
    kept = batch.ctx_positions >= batch.computed_from[:, None]
    return batch._replace(ctx_valid=batch.ctx_valid & (~cached | kept))


# --------------------------------------------------------------------------- training


def position_weights(cfg: BlockDrafterConfig, decay: float) -> jax.Array:
    """``[k]`` loss weight of each draft position: ``decay^j`` for j = 0 .. k - 1."""
    return decay ** jnp.arange(cfg.block, dtype=jnp.float32)


def loss_and_metrics(params: dict, head: dict, cfg: BlockDrafterConfig, target: ModelConfig, batch: Batch,
                     weights: jax.Array, soft_labels: bool) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Weighted cross-entropy over the k positions (module docstring); metrics: ``accepted [B]`` (drafts matching
    the labels before the first miss) and ``correct [k]`` (accuracy per position)."""
    logits = block_model.draft_logits(params, head, cfg, target, batch.ctx_hidden, batch.newest,
                                        batch.ctx_positions, batch.ctx_valid)
    if soft_labels:
        p = jax.nn.softmax(jax.lax.stop_gradient(llama.logits(head, target, batch.label_hidden)), axis=-1)
        ce = -(p * jax.nn.log_softmax(logits, axis=-1)).sum(-1)
    else:
        ce = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, batch.labels[..., None], -1)[..., 0]
    w = weights[None] * batch.label_valid
    loss = (ce * w).sum() / w.sum()
    correct = (jnp.argmax(logits, axis=-1) == batch.labels) & batch.label_valid
    return loss, {"accepted": jnp.cumprod(correct, axis=-1).sum(-1),
                  "correct": correct.sum(0) / jnp.maximum(batch.label_valid.sum(0), 1)}


def optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then apexw (bf16 moments) with its learning rate injected per step (``lr_at``); no
    weight decay on vectors (norms)."""
    decay_mask = lambda params: jax.tree.map(lambda w: w.ndim >= 2, params)
    return optax.chain(optax.clip_by_global_norm(CLIP_NORM),
                       optax.inject_hyperparams(apexw, static_args=("state_dtype", "mask"))(
                           learning_rate=tc.lr, weight_decay=tc.weight_decay, mask=decay_mask,
                           state_dtype=jnp.bfloat16))


def lr_at(tc: TrainConfig, step: int, progress: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``FINAL_LR_SHARE`` over ``progress`` in [0, 1]."""
    cosine = FINAL_LR_SHARE + (1 - FINAL_LR_SHARE) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return tc.lr * min(1.0, (step + 1) / tc.warmup) * cosine


@functools.partial(jax.jit, static_argnames=("cfg", "target", "tx", "batch_size", "truncate_prob", "soft_labels"),
                   donate_argnames=("params", "state"))
def train_step(params: dict, state: Any, head: dict, data: TargetData, key: jax.Array, lr: jax.Array,
               weights: jax.Array, *, cfg: BlockDrafterConfig, target: ModelConfig, tx: optax.GradientTransformation,
               batch_size: int, truncate_prob: float, soft_labels: bool) -> tuple[dict, Any, jax.Array, dict]:
    """One step on ``batch_size`` anchors drawn uniformly with ``key`` (contexts truncated as
    ``truncate_context``)."""
    anchor_key, truncate_key = jax.random.split(key)
    anchors = data.anchors[jax.random.randint(anchor_key, (batch_size,), 0, data.anchors.shape[0])]
    batch = truncate_context(gather(data, anchors, cfg), truncate_key, truncate_prob)
    (loss, metrics), grads = jax.value_and_grad(loss_and_metrics, has_aux=True)(params, head, cfg, target, batch,
                                                                                 weights, soft_labels)
    state[1].hyperparams["learning_rate"] = lr  # state: (clip state, inject_hyperparams state of apexw)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss, metrics


def train(tc: TrainConfig, cfg: BlockDrafterConfig, target: ModelConfig, head: dict, params: dict,
          data: TargetData, seconds: float, log: Callable[[str], None] = print) -> tuple[dict, list[dict]]:
    """Train the drafter ``params`` (``block_model.init_params``; donated) for ``tc.steps`` steps or
    ``seconds``, whichever ends first; (params, log rows)."""
    tx = optimizer(tc)
    state = tx.init(params)
    weights = position_weights(cfg, tc.decay)
    key = jax.random.key(tc.seed + 1)
    rows, start, step = [], time.perf_counter(), 0
    while (progress := max(step / tc.steps, (time.perf_counter() - start) / seconds)) < 1:
        params, state, loss, metrics = train_step(params, state, head, data, jax.random.fold_in(key, step),
                                                  jnp.float32(lr_at(tc, step, progress)), weights, cfg=cfg,
                                                  target=target, tx=tx, batch_size=tc.batch,
                                                  truncate_prob=tc.truncate_prob, soft_labels=tc.soft_labels)
        step += 1
        if step % SYNC_EVERY == 0:  # the host would run ahead of the device, past the time budget
            loss.block_until_ready()
        if step % LOG_EVERY == 0 or step == 1:
            rows.append({"step": step, "seconds": round(time.perf_counter() - start, 1),
                         "loss": round(float(loss), 4),
                         "acceptance_length": round(1 + float(metrics["accepted"].mean()), 3)})  # on its batch
            log(f"  train {rows[-1]}")
    if rows[-1]["step"] != step:
        rows.append({"step": step, "seconds": round(time.perf_counter() - start, 1), "loss": round(float(loss), 4),
                     "acceptance_length": round(1 + float(metrics["accepted"].mean()), 3)})
    return params, rows


# --------------------------------------------------------------------------- evaluation


@functools.partial(jax.jit, static_argnames=("cfg", "target"))
def _eval_batch(params: dict, head: dict, data: TargetData, anchors: jax.Array, weights: jax.Array, *,
                cfg: BlockDrafterConfig, target: ModelConfig) -> tuple[jax.Array, dict]:
    return loss_and_metrics(params, head, cfg, target, gather(data, anchors, cfg), weights, soft_labels=False)


def evaluate_offline(params: dict, head: dict, cfg: BlockDrafterConfig, target: ModelConfig, data: TargetData,
                     decay: float, batch: int) -> dict:
    """Teacher-forced over every anchor of ``data``: acceptance length against the greedy target, loss (on the
    greedy tokens), accuracy per draft position."""
    anchors = np.asarray(data.anchors)
    weights = position_weights(cfg, decay)
    accepted, correct, losses = [], [], []
    for i in range(0, len(anchors), batch):
        chunk = anchors[i:i + batch]
        loss, metrics = _eval_batch(params, head, data, np.pad(chunk, (0, batch - len(chunk)), mode="edge"), weights,
                                    cfg=cfg, target=target)
        accepted.append(np.asarray(metrics["accepted"])[:len(chunk)])
        correct.append(np.asarray(metrics["correct"]) * len(chunk))
        losses.append(float(loss) * len(chunk))
    n = len(anchors)
    return {"anchors": n, "loss": round(sum(losses) / n, 4),
            "acceptance_length": round(1 + float(np.concatenate(accepted).mean()), 3),
            "accuracy_per_position": [round(float(c), 3) for c in np.sum(correct, axis=0) / n]}


def evaluate_online(model: str | Path | None, tc: TrainConfig, cfg: BlockDrafterConfig, params: dict,
                    prompts: Sequence[Prompt], greedy: Sequence[list[int]]) -> dict:
    """The engine with ``BlockDrafter`` speculation (k = block) on ``prompts``: acceptance, and how many outputs
    equal the plain greedy answers ``greedy``."""
    spec = SpecConfig(lambda target, target_params: BlockDrafter(cfg, params, target, target_params,
                                                                 max_seqs=tc.eval_concurrency), k=cfg.block)
    engine = Engine(model, dtype=DTYPES[tc.dtype], num_blocks=tc.eval_concurrency * (tc.max_tokens // BLOCK_SIZE + 32),
                    block_size=BLOCK_SIZE, max_running=tc.eval_concurrency, token_budget=GENERATION_TOKEN_BUDGET,
                    speculative=spec)
    outputs = [answer for _, answer in generate(engine, prompts, tc.max_tokens)]
    stats = engine.spec_stats
    return {"prompts": len(prompts), "concurrency": tc.eval_concurrency, "k": cfg.block,
            "acceptance_length": round(stats.mean_acceptance_length, 3),
            "acceptance_rate": round(stats.acceptance_rate, 3),
            "identical_outputs": sum(o == g for o, g in zip(outputs, greedy, strict=True))}


# --------------------------------------------------------------------------- the run


def run(tc: TrainConfig, out: str | Path, model: str | Path | None = None,
        prompts: tuple[Sequence[Prompt], Sequence[Prompt]] | None = None,
        log: Callable[[str], None] = print) -> dict:
    """Data, training, evaluation and checkpoint (module docstring); returns the metrics written to ``out``.

    model: what ``Engine`` loads (None: the embedded SmolLM2-135M-Instruct); prompts: (training, held-out),
    default ``chat_prompts(tc.num_eval_prompts)`` (at most ``tc.max_prompts`` training ones).
    """
    start = time.perf_counter()
    elapsed = lambda: round(time.perf_counter() - start, 1)
    train_prompts, eval_prompts = prompts or chat_prompts(tc.num_eval_prompts, tc.seed)
    train_prompts = train_prompts[:tc.max_prompts]
    engine = Engine(model, dtype=DTYPES[tc.dtype], num_blocks=len(eval_prompts) * (tc.max_tokens // BLOCK_SIZE + 32),
                    block_size=BLOCK_SIZE, max_running=len(eval_prompts), token_budget=GENERATION_TOKEN_BUDGET)
    target, target_params = engine.cfg, engine.runner.params
    log(f"[{elapsed()}s] greedy answers ({tc.max_tokens} tokens at most) to {len(eval_prompts)} held-out prompts "
        f"(the engine), then to up to {len(train_prompts)} training prompts, {tc.gen_batch} at a time for "
        f"{tc.gen_seconds:.0f}s")
    eval_pairs = generate(engine, eval_prompts, tc.max_tokens)
    prompt_ids = [engine.encode(p) for p in train_prompts]
    train_pairs, gen_start, round_ = [], time.perf_counter(), 0
    while ((left := tc.gen_seconds - (time.perf_counter() - gen_start)) > 0 and (round_ == 0 or tc.gen_temperature)
           and sum(len(p) + len(a) for p, a in train_pairs) < tc.max_train_tokens):
        train_pairs += answers(target, target_params, prompt_ids, tc.max_tokens, engine.eos_ids, tc.gen_batch, left,
                               0.0 if round_ == 0 else tc.gen_temperature, seed=round_ * len(prompt_ids))
        round_ += 1
    del engine
    cfg = BlockDrafterConfig.for_target(target, block=tc.block, window=tc.window, layers=tc.layers)
    log(f"[{elapsed()}s] {len(train_pairs)} training answers in {round_} rounds; teacher-forced hidden states "
        f"after layers {cfg.target_layers}")
    dtype = DTYPES[tc.compute_dtype]
    train_data = target_data(target, target_params, train_pairs, cfg.target_layers, tc.tokens_per_pass, dtype)
    eval_data = target_data(target, target_params, eval_pairs, cfg.target_layers, tc.tokens_per_pass, dtype)
    data_seconds = elapsed()
    head = jax.tree.map(lambda w: w.astype(dtype), block_model.target_head(target_params))
    train_seconds = max(tc.time_budget - tc.eval_seconds - data_seconds, MIN_TRAIN_SHARE * tc.time_budget)
    log(f"[{elapsed()}s] training on {train_data.anchors.shape[0]} anchors ({train_data.tokens.shape[0]} tokens) "
        f"for {tc.steps} steps or {train_seconds:.0f}s")
    initial = block_model.init_params(cfg, target, jax.random.key(tc.seed), target_params)
    params, curve = train(tc, cfg, target, head, initial, train_data, train_seconds, log)
    folder = block_model.save(out, cfg, params)
    log(f"[{elapsed()}s] saved {folder} after {curve[-1]['step']} steps; evaluating on {len(eval_prompts)} "
        "held-out prompts")
    offline = evaluate_offline(params, head, cfg, target, eval_data, tc.decay, tc.batch)
    log(f"  teacher-forced {offline}")
    online = evaluate_online(model, tc, cfg, params, eval_prompts, [a for _, a in eval_pairs])
    log(f"  engine {online}")
    metrics = {"config": dataclasses.asdict(tc), "drafter": dataclasses.asdict(cfg),
               "device": jax.devices()[0].device_kind,
               "data": {"train_prompts": len(train_pairs), "eval_prompts": len(eval_prompts),
                        "train_tokens": int(train_data.tokens.shape[0]),
                        "train_anchors": int(train_data.anchors.shape[0]),
                        "answer_tokens_mean": round(float(np.mean([len(a) for _, a in train_pairs])), 1)},
               "seconds": {"data": data_seconds, "total": elapsed()}, "train_curve": curve,
               "eval_teacher_forced": offline, "eval_engine": online}
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log(f"[{elapsed()}s] done: acceptance length {online['acceptance_length']} (engine), "
        f"{offline['acceptance_length']} (teacher-forced); {folder / 'metrics.json'}")
    return metrics


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.train_drafter", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="checkpoint folder to write (created)")
    parser.add_argument("--model", default=None, help="the target: a HF folder or a .gguf (default: SmolLM2-135M)")
    parser.add_argument("--cpu", action="store_true", help="the tiny CPU configuration (CPU_CONFIG) on the CPU")
    for f in dataclasses.fields(TrainConfig):  # each overrides the chosen configuration's value
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=None)
    args = parser.parse_args(argv)
    tc = dataclasses.replace(CPU_CONFIG if args.cpu else TrainConfig(),
                             **{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                                if getattr(args, f.name) is not None})
    if args.cpu:
        jax.config.update("jax_platforms", "cpu")
    run(tc, args.out, args.model)

