"""``Engine``: add requests, step, stream outputs; ``generate`` runs a batch of prompts to completion.

Each ``step`` is one scheduler decision and one device call (``runner.py``); outputs carry each sequence's new
token, its text delta (stop strings cut), and, when the sequence is done, why. A request with
``SamplingParams.n = k`` runs as k sequences (sample i seeded with seed + i).
"""

import dataclasses
import itertools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from serving import weights
from serving.config import ModelConfig
from serving.engine.blocks import BlockAllocator
from serving.engine.request import Sequence as Seq
from serving.engine.runner import ModelRunner
from serving.engine.sampler import SampleRow
from serving.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from serving.engine.scheduler import Scheduler
from serving.kv_cache import PagedKV, PagedLatentKV, SeqChunk
from serving.loaders import load_model
from serving.loaders.gguf import load_gguf
from serving.models import model_module
from serving.tokenizer import Tokenizer

SEED_RANGE = 2**32  # seeds are uint32
Prompt = Sequence[int] | str | Sequence[Mapping[str, Any]]  # token ids, text, or chat messages


@dataclasses.dataclass
class StepOutput:
    """What one step produced for one sequence."""

    request_id: str
    index: int  # which of the request's n samples
    token_id: int
    text: str  # new text (may be "" while a character or a possible stop string is incomplete)
    finished: bool
    finish_reason: str | None  # "stop" | "length" once finished
    logprobs: dict | None  # {"logprob": chosen, "top": [(id, logprob), ...]} when requested


@dataclasses.dataclass
class Completion:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[dict] | None


@dataclasses.dataclass
class RequestResult:
    request_id: str
    prompt_ids: list[int]
    outputs: list[Completion]  # one per sample, by index
    num_cached_tokens: int  # prompt tokens the prefix cache supplied (first sample, last admission)


def _eos_from_folder(path: Path) -> tuple[int, ...]:
    """eos ids of a HF folder without a tokenizer: generation_config.json, else config.json."""
    for name in ("generation_config.json", "config.json"):
        if (path / name).is_file():
            eos = json.loads((path / name).read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (eos,)
    return ()


def load(model: str | Path | None, dtype: jnp.dtype) -> tuple[ModelConfig, dict, Tokenizer | None, tuple[int, ...]]:
    """(config, params, tokenizer or None, eos ids) of a GGUF file, a HF folder, or (None) the default model."""
    path = Path(model) if model is not None else weights.default_model_gguf()
    if path.is_file():
        checkpoint = load_gguf(path)
        cfg = ModelConfig.from_hf(checkpoint.config)
        params = model_module(cfg.family).params_from_hf(cfg, checkpoint.tensors, dtype)
        return cfg, params, checkpoint.tokenizer, checkpoint.tokenizer.eos_token_ids
    cfg, params = load_model(path, dtype)
    tokenizer = Tokenizer.from_hf_folder(path) if (path / "tokenizer.json").is_file() else None
    return cfg, params, tokenizer, tokenizer.eos_token_ids if tokenizer else _eos_from_folder(path)


def create_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: jnp.dtype) -> Any:
    """The model's paged cache: latent pages for MLA (DeepSeek), separate k/v pages otherwise."""
    return (PagedLatentKV if cfg.is_mla else PagedKV).create(cfg, num_blocks, block_size, dtype)


class Engine:
    """A continuous-batching engine over one model.

    Args:
      model: a GGUF file, a HF checkpoint folder, or None for the embedded SmolLM2-135M-Instruct.
      dtype: params and cache dtype.
      num_blocks, block_size: the paged cache (num_blocks * block_size tokens in all).
      max_running: the most sequences in one step; token_budget: the most new tokens in one step.
      max_model_len: context length (default: the model's max_position).
    """

    def __init__(self, model: str | Path | None = None, dtype: jnp.dtype = jnp.float32, num_blocks: int = 256,
                 block_size: int = 16, max_running: int = 32, token_budget: int = 256,
                 max_model_len: int | None = None):
        self.cfg, params, self.tokenizer, self.eos_ids = load(model, dtype)
        self.max_model_len = min(self.cfg.max_position, max_model_len or self.cfg.max_position)
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.scheduler = Scheduler(self.allocator, max_running, token_budget)
        kv = create_cache(self.cfg, num_blocks, block_size, dtype)
        self.runner = ModelRunner(self.cfg, params, model_module(self.cfg.family).forward, kv, block_size)
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng()
        self._requests: dict[str, tuple[list[int], list[Seq]]] = {}

    @classmethod
    def from_default(cls, **kwargs: Any) -> "Engine":
        """The engine over the embedded SmolLM2-135M-Instruct."""
        return cls(None, **kwargs)

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
                    cache_salt: str | None = None) -> str:
        """Queue a request; returns its id. A prompt longer than the cache or the context -> ValueError."""
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.encode(prompt)
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(SEED_RANGE))
        seqs = [Seq(next(self._ids), request_id, i, list(ids), params, (seed + i) % SEED_RANGE, self.eos_ids,
                    self.max_model_len, self.tokenizer.decode_stream() if self.tokenizer else None, cache_salt)
                for i in range(params.n)]
        for seq in seqs:
            self.scheduler.add(seq)
        self._requests[request_id] = (ids, seqs)
        return request_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        """Run one scheduled step; one output per sequence that sampled a token."""
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        seqs = [c.seq for c in chunks]
        rows = [SampleRow(s.params, s.seed, len(s.output_ids), s.prompt_ids, s.output_ids) for s in seqs]
        wants_top = any(c.samples and c.seq.params.logprobs for c in chunks)
        result = self.runner.run([SeqChunk(s.block_table, c.start, c.count) for s, c in zip(seqs, chunks, strict=True)],
                                 [s.tokens[c.start:c.start + c.count] for s, c in zip(seqs, chunks, strict=True)],
                                 rows, MAX_LOGPROBS if wants_top else 0)
        logprobs = {}
        for i, seq in enumerate(seqs):
            n = seq.params.logprobs
            if n is not None:
                top = list(zip(result.top_ids[i, :n].tolist(), result.top_logprobs[i, :n].tolist(), strict=True))
                logprobs[seq.seq_id] = {"logprob": float(result.logprobs[i]), "top": top}
        outputs = []
        for seq, text in self.scheduler.update(chunks, result.tokens.tolist()):
            entry = logprobs.get(seq.seq_id)
            if entry is not None:
                seq.logprobs.append(entry)
            outputs.append(StepOutput(seq.request_id, seq.index, seq.output_ids[-1], text, seq.finished,
                                      seq.finish_reason, entry))
        return outputs

    def result(self, request_id: str) -> RequestResult:
        """The request's outputs so far (complete once every sample finished)."""
        ids, seqs = self._requests[request_id]
        outputs = [Completion(s.index, list(s.output_ids), s.text, s.finish_reason,
                              s.logprobs if s.params.logprobs is not None else None) for s in seqs]
        return RequestResult(request_id, ids, outputs, seqs[0].num_cached_tokens)

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestResult]:
        """Run ``prompts`` (with one params for all, or one each) to completion; results in prompt order."""
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"generate: {len(params_list)} SamplingParams for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        while any(not s.finished for i in ids for s in self._requests[i][1]):
            self.step()
        return [self.result(i) for i in ids]
