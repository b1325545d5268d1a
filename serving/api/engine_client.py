"""What the front end needs of an engine, whoever runs it: ``EngineClient``, and the engine's facts and load.

Two clients implement it: ``AsyncEngine`` (``async_engine.py``: the engine on a thread of the server's process)
and ``ProcessEngine`` (``process_engine.py``: the engine in its own core process, over IPC). Both

- ``submit`` a tokenized request and return its ``RequestStream`` (``StepOutput``s with their text, then the
  ``RequestResult``); ``EngineFullError`` at once while ``capacity`` sequences are in flight;
  ``EngineUnavailableError`` while the engine is not ready (warming, stopped, crashed);
- fail a refused request's stream with its ``ValueError`` (400) and a failed step's requests with its
  ``StepError``; ``abort`` frees a request's cache blocks;
- report ``status()`` (``{"status": "ok" | "warming" | ..., ...}``, ready when "ok") and ``stats()``.

``model`` is what the routes read of the served model: ``tokenizer``, ``cfg``, ``eos_ids``, ``max_model_len``
and ``encode(prompt)`` (the ``Engine`` itself in process; a ``ModelInfo`` sent by the core otherwise).
"""

import dataclasses
import threading
from collections.abc import Callable
from typing import Any, Protocol

from serving.engine.kv_tiers import TierStats
from serving.engine.sampling_params import SamplingParams
from serving.images import ImageInput
from serving.llm_engine import Engine, EngineFullError, StepOutput
from serving.spec_decode import SpecStats

OK = "ok"  # the status of a client that serves
WARMING = "warming"  # the status of one that will serve once its engine has loaded and compiled; any other: stopped


class EngineUnavailableError(RuntimeError):
    """The engine does not take requests now: still warming up, stopped, or its process died."""


@dataclasses.dataclass
class EngineStats:
    """The engine's load: sequences, cache blocks, expert routing counts, speculative decoding and cache tier
    counters."""

    waiting: int = 0
    running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_block_size: int = 0
    expert_tokens: list[list[int]] = dataclasses.field(default_factory=list)  # [layers][experts]; [] if dense
    spec: SpecStats | None = None  # None without speculative decoding
    tiers: TierStats | None = None  # the prefix cache's host/disk tiers; None without them

    @classmethod
    def of(cls, engine: Engine, experts: bool = True) -> "EngineStats":
        """``engine``'s stats now (``experts=False``: without the expert counts, which cost a list copy)."""
        allocator = engine.scheduler.allocator
        return cls(len(engine.scheduler.waiting), len(engine.scheduler.running),
                   allocator.num_blocks - allocator.num_free, allocator.num_blocks, allocator.block_size,
                   engine.runner.expert_load.tolist() if experts and engine.cfg.num_experts else [],
                   dataclasses.replace(engine.spec_stats) if engine.speculative is not None else None,
                   dataclasses.replace(engine.tier_stats) if engine.tier_stats is not None else None)

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, fields: dict[str, Any]) -> "EngineStats":
        spec, tiers = fields.get("spec"), fields.get("tiers")
        return cls(**{**fields, "spec": SpecStats(**spec) if spec is not None else None,
                      "tiers": TierStats(**tiers) if tiers is not None else None})


class Admission:
    """Counts the sequences in flight and refuses a request at once (``EngineFullError``) that would take them
    past ``capacity`` (None: no limit), so a 503 never waits for an engine step. Thread-safe."""

    def __init__(self, capacity: int | None):
        self.capacity, self.in_flight = capacity, 0
        self._lock = threading.Lock()

    def admit(self, n: int) -> None:
        with self._lock:
            if self.capacity is not None and self.in_flight + n > self.capacity:
                raise EngineFullError(f"server is at capacity ({self.in_flight} sequences in flight, limit "
                                      f"{self.capacity}): retry later")
            self.in_flight += n

    def release(self, n: int) -> None:
        with self._lock:
            self.in_flight -= n


OnStep = Callable[[list[StepOutput], dict[str, Any]], None]  # (a step's outputs, their streams by request id)


class EngineClient(Protocol):
    """The front end's engine (module docstring)."""

    model: Any
    capacity: int | None  # sequences admitted at once (max_running + max_queue), None: no limit
    speculative: bool

    @property
    def in_flight(self) -> int: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def status(self) -> dict[str, Any]: ...

    def stats(self, experts: bool = True) -> EngineStats: ...

    def submit(self, prompt_ids: list[int], params: SamplingParams, prefix: str = "req-",
               cache_salt: str | None = None, images: list[ImageInput] | None = None) -> Any: ...

    def abort(self, request_id: str) -> None: ...
