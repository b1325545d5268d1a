"""The wire between the server's front end and its engine core process: msgpack of plain data over ZeroMQ.

Two PUSH/PULL pairs on ``ipc://`` sockets in a private temporary folder (the front end binds, the core
connects): commands go front end -> core, events core -> front end. Only plain data crosses (ints, floats,
str, lists, dicts, None; never pickle), so a message is decoded without running anything it names.

Commands (lists, first item the kind):
  ``["add", request_id, prompt_ids, params, cache_salt, images]``  params: ``params_to_wire(SamplingParams)``,
      images: ``images_to_wire`` (each image's float32 patches as bytes, their shape, grid and digest)
  ``["abort", request_id]``
  ``["stop"]``
Events (dicts with a "kind"):
  ``loaded``   the model's facts the front end needs (``model_info``), once the engine is built
  ``warming``  ``progress``: the arguments of ``Engine.warm_up``'s progress callback
  ``ready``    serving from now on; ``startup``: the seconds the core spent building the engine and warming it
               up (``build_s``, ``warm_up_s``) and the calls it read back exported (``exported_loaded``)
  ``step``     one engine step: ``outputs`` ``[[request_id, index, token_id, finished, finish_reason, logprobs],
               ...]`` for every sequence that sampled, ``done`` ``{request_id: num_cached_tokens}`` of requests
               whose samples all finished, ``prompt_logprobs`` ``{request_id: [entry or None, ...]}`` of those done
               with ``SamplingParams.prompt_logprobs`` (``RequestResult.prompt_logprobs``), ``refused``
               ``[[request_id, error type, message]]`` (requests the engine would not take, or whose output
               constraint failed mid-output: each fails alone), ``failed`` ``[[request_ids, message]]`` (a step's
               ``StepError``), ``aborted`` request ids, and ``stats``
  ``error``    the core could not start (``message``); it exits
"""

import dataclasses
from typing import Any

import msgpack
import numpy as np

from serving.engine.sampling_params import SamplingParams
from serving.images import ImageInput
from serving.structured import ConstraintSpec

ADD, ABORT, STOP = "add", "abort", "stop"
LOADED, WARMING, READY, STEP, ERROR = "loaded", "warming", "ready", "step", "error"


def pack(message: Any) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """``params`` as a dict of plain fields (the constraint as ``{"kind", "value"}`` or None)."""
    return dataclasses.asdict(params)


def images_to_wire(images: list[ImageInput]) -> list[list[Any]]:
    """Preprocessed images as plain data: ``[patches as float32 bytes, [rows, cols], grid, digest]`` each."""
    return [[np.ascontiguousarray(i.pixels, np.float32).tobytes(), list(i.pixels.shape), list(i.grid), i.digest]
            for i in images]


def images_from_wire(wire: list[list[Any]]) -> list[ImageInput]:
    """``images_to_wire``'s images back (a byte count that does not match the shape: ValueError)."""
    images = []
    for data, shape, grid, digest in wire:
        if len(data) != 4 * shape[0] * shape[1]:
            raise ValueError(f"image patches of {len(data)} bytes: expected float32 {shape}")
        images.append(ImageInput(np.frombuffer(data, np.float32).reshape(shape), tuple(grid), digest))
    return images


def params_from_wire(fields: dict[str, Any]) -> SamplingParams:
    """The ``SamplingParams`` of ``params_to_wire``'s dict (validated again on construction)."""
    constraint = fields.get("constraint")
    if constraint is not None:
        value = constraint["value"]
        constraint = ConstraintSpec(constraint["kind"], tuple(value) if isinstance(value, list) else value)
    return SamplingParams(**{**fields, "constraint": constraint})


def plain(value: Any) -> Any:
    """``value`` with tuples as lists and anything msgpack cannot carry as its ``str`` (progress reports)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)
