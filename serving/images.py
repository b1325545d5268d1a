"""Images in prompts, on the host: decoding and preprocessing (Pillow), placeholder tokens, multimodal positions,
and the per-step inputs a vision-language model's forward pass reads (``MultimodalInputs``).

Preprocessing follows the checkpoint's ``preprocessor_config.json`` (Qwen2-VL's image processor, which Qwen3-VL
uses): the image in RGB (transparency composited onto white) is resized with Pillow's bicubic filter to the size
``smart_resize`` picks (each side a multiple of ``patch_size * merge_size``, the pixel count within
[``size.shortest_edge``, ``size.longest_edge``], the aspect ratio kept), scaled by ``rescale_factor``, normalized by
``image_mean`` / ``image_std``, and cut into ``patch_size`` squares in merge-block order, each repeated
``temporal_patch_size`` times (a still image is a one-frame video): ``[patches, channels * temporal_patch_size *
patch_size^2]`` and the grid ``(1, h, w)``.

A prompt holds an image as ``<|vision_start|>``, one ``image_token_id`` per merged block (``h * w /
merge_size^2``), ``<|vision_end|>``: the chat template writes ``<|vision_start|><|image_pad|><|vision_end|>`` per
image part and ``expand_placeholders`` repeats each ``<|image_pad|>`` to its image's count.
"""

import base64
import binascii
import dataclasses
import hashlib
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image

from serving.config import VisionConfig
from serving.json_files import read_json

PROCESSOR_FILE = "preprocessor_config.json"
MAX_ASPECT_RATIO = 200  # smart_resize refuses longer sides more than 200x the shorter (as HF's processor)
DATA_URL_PREFIX = "data:"


class ImageError(ValueError):
    """An image that cannot be used: undecodable, of a kind not accepted, or over a limit (``status``: the HTTP
    status the API answers with, 400 or 413)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class ImageProcessorConfig:
    """The preprocessing fields of a Qwen2-VL / Qwen3-VL ``preprocessor_config.json``."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56  # size.shortest_edge
    max_pixels: int = 28 * 28 * 1280  # size.longest_edge
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    @classmethod
    def from_folder(cls, path: str | Path) -> "ImageProcessorConfig":
        """Read ``path/preprocessor_config.json`` (FileNotFoundError without one; ValueError for a setting this
        preprocessing does not follow, naming it)."""
        file = Path(path) / PROCESSOR_FILE
        if not file.is_file():
            raise FileNotFoundError(f"no {PROCESSOR_FILE} in {str(path)!r}: a vision-language checkpoint needs its "
                                    "image processor's settings")
        raw = read_json(file)
        for key, expected in (("do_resize", True), ("do_rescale", True), ("do_normalize", True),
                              ("do_convert_rgb", True), ("resample", 3)):
            if raw.get(key, expected) != expected:
                raise ValueError(f"{file}: {key} = {raw[key]!r}: expected {expected!r} (Qwen2-VL preprocessing)")
        size = raw.get("size") or {}
        return cls(patch_size=raw.get("patch_size", cls.patch_size),
                   temporal_patch_size=raw.get("temporal_patch_size", cls.temporal_patch_size),
                   merge_size=raw.get("merge_size", cls.merge_size),
                   min_pixels=size.get("shortest_edge", raw.get("min_pixels", cls.min_pixels)),
                   max_pixels=size.get("longest_edge", raw.get("max_pixels", cls.max_pixels)),
                   image_mean=tuple(raw.get("image_mean", cls.image_mean)),
                   image_std=tuple(raw.get("image_std", cls.image_std)),
                   rescale_factor=raw.get("rescale_factor", cls.rescale_factor))

    @classmethod
    def for_vision(cls, vision: VisionConfig) -> "ImageProcessorConfig":
        """The default settings with the patch geometry of the encoder ``vision`` (a model without its
        ``preprocessor_config.json``, e.g. random weights)."""
        return cls(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                   merge_size=vision.spatial_merge_size)

    def check(self, vision: VisionConfig) -> None:
        """ValueError unless the patches this config cuts are those the encoder ``vision`` takes."""
        for name, mine, theirs in (("patch_size", self.patch_size, vision.patch_size),
                                   ("temporal_patch_size", self.temporal_patch_size, vision.temporal_patch_size),
                                   ("merge_size", self.merge_size, vision.spatial_merge_size),
                                   ("image_mean channels", len(self.image_mean), vision.in_channels)):
            if mine != theirs:
                raise ValueError(f"{PROCESSOR_FILE} {name} = {mine}: expected the model's {theirs}")


class ImageInput(NamedTuple):
    """One preprocessed image: its patches, patch grid and content digest (the prefix-cache key part)."""

    pixels: np.ndarray  # [t * h * w, patch_dim] float32
    grid: tuple[int, int, int]  # (t, h, w) patches
    digest: str  # sha256 of the decoded RGB pixels and their size

    def num_tokens(self, merge_size: int) -> int:
        """Placeholder tokens the image takes in a prompt: ``t * h * w / merge_size^2``."""
        t, h, w = self.grid
        return t * h * w // merge_size ** 2


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) Qwen2-VL resizes to: each a multiple of ``factor`` nearest the original, scaled as one
    (aspect ratio kept) into [min_pixels, max_pixels] pixels."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(f"image of {width}x{height} pixels: expected an aspect ratio under {MAX_ASPECT_RATIO}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor)
                                                                                  * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def to_rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    """``image`` in RGB, any transparency composited onto white (as HF's ``convert_to_rgb``)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        background = PIL.Image.new("RGBA", image.size, (255, 255, 255, 255))
        return PIL.Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def preprocess(image: PIL.Image.Image, config: ImageProcessorConfig) -> ImageInput:
    """``image`` -> patches as the checkpoint's processor cuts them (module docstring)."""
    rgb = to_rgb(image)
    digest = hashlib.sha256(f"{rgb.size}".encode() + rgb.tobytes()).hexdigest()
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    height, width = smart_resize(rgb.height, rgb.width, p * m, config.min_pixels, config.max_pixels)
    resized = np.asarray(rgb.resize((width, height), PIL.Image.Resampling.BICUBIC), np.float32)
    normalized = (resized * np.float32(config.rescale_factor) - np.asarray(config.image_mean, np.float32)) / \
        np.asarray(config.image_std, np.float32)
    channels = normalized.shape[-1]
    gh, gw = height // p, width // p
    patches = normalized.transpose(2, 0, 1).reshape(channels, gh // m, m, p, gw // m, m, p)
    patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # (block row, block col, row, col, C, ph, pw)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
    return ImageInput(np.ascontiguousarray(patches.reshape(gh * gw, channels * t * p * p)), (1, gh, gw), digest)


def decode_image(data: bytes, max_pixels: int) -> PIL.Image.Image:
    """Encoded image bytes (any format Pillow reads) -> the image, fully loaded. ``ImageError`` for bytes that
    are no image, or an image of more than ``max_pixels`` pixels (413; checked before its pixels are decoded)."""
    try:
        image = PIL.Image.open(io.BytesIO(data))
    except (PIL.UnidentifiedImageError, OSError) as e:
        raise ImageError(f"image data ({len(data)} bytes) is not an image Pillow can read: {e}") from None
    if image.width * image.height > max_pixels:
        raise ImageError(f"image of {image.width}x{image.height} pixels: expected at most {max_pixels} pixels", 413)
    try:
        image.load()
    except (OSError, PIL.Image.DecompressionBombError) as e:
        raise ImageError(f"image data could not be decoded: {e}") from None
    return image


def decode_base64(data: str, where: str) -> bytes:
    """Base64 text -> bytes; ``ImageError`` naming ``where`` for text that is not base64."""
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{where}: the image data is not valid base64") from None


def split_data_url(url: str, where: str) -> tuple[str, str]:
    """``data:<media type>;base64,<data>`` -> (media type, base64 data); ``ImageError`` naming ``where`` else."""
    header, comma, data = url.partition(",")
    if not url.startswith(DATA_URL_PREFIX) or not comma or not header.endswith(";base64"):
        raise ImageError(f"{where}: expected a base64 data URL (data:image/png;base64,...)")
    return header[len(DATA_URL_PREFIX):-len(";base64")], data


def expand_placeholders(ids: Sequence[int], images: Sequence[ImageInput], vision: VisionConfig) -> list[int]:
    """``ids`` with the i-th ``image_token_id`` repeated to image i's token count (the chat template writes one per
    image). ValueError unless the prompt holds exactly one placeholder per image."""
    token = vision.image_token_id
    found = sum(1 for t in ids if t == token)
    if found != len(images):
        raise ValueError(f"the prompt holds {found} image placeholders (token {token}) for {len(images)} images: "
                         "expected one per image (the chat template writes them)")
    out, remaining = [], iter(images)
    for t in ids:
        out.extend([t] * next(remaining).num_tokens(vision.spatial_merge_size) if t == token else [t])
    return out


def image_spans(ids: Sequence[int], images: Sequence[ImageInput], vision: VisionConfig) -> list[tuple[int, int]]:
    """Each image's (first, end) token positions in the expanded prompt ``ids``; ValueError unless each image's
    run of placeholder tokens has its token count."""
    token, spans, position = vision.image_token_id, [], 0
    for image in images:
        while position < len(ids) and ids[position] != token:
            position += 1
        count = image.num_tokens(vision.spatial_merge_size)
        if ids[position:position + count] != [token] * count or (position + count < len(ids)
                                                               and ids[position + count] == token):
            raise ValueError(f"image {len(spans)}: expected a run of {count} placeholder tokens at position "
                             f"{position}")
        spans.append((position, position + count))
        position += count
    if token in ids[position:]:
        raise ValueError(f"the prompt holds more placeholder tokens ({token}) than its {len(images)} images take")
    return spans


def rope_positions(length: int, spans: Sequence[tuple[int, int]], grids: Sequence[tuple[int, int, int]],
                   merge_size: int) -> tuple[np.ndarray, int]:
    """Qwen3-VL's multimodal positions of a prompt of ``length`` tokens with images at ``spans``: ``[length, 3]``
    int32 (temporal, height, width) and the shift of every later token (``max + 1 - length``).

    Text runs count on from where the last run ended, equal on the three axes; an image of ``h x w`` merged
    tokens starting at p takes (p + frame, p + row, p + column), and the text after it resumes at p + max(h, w).
    """
    out = np.zeros((length, 3), np.int64)
    position, cursor = 0, 0
    for (first, end), (t, h, w) in zip(spans, grids, strict=True):
        out[cursor:first] = (position + np.arange(first - cursor))[:, None]
        position += first - cursor
        frames, rows, cols = np.meshgrid(np.arange(t), np.arange(h // merge_size), np.arange(w // merge_size),
                                         indexing="ij")
        out[first:end] = position + np.stack([frames.ravel(), rows.ravel(), cols.ravel()], axis=1)
        position += max(h, w) // merge_size
        cursor = end
    out[cursor:] = (position + np.arange(length - cursor))[:, None]
    return out.astype(np.int32), int(out.max() + 1 - length) if length else 0


class MultimodalInputs(NamedTuple):
    """A vision-language model's per-step inputs beside the tokens ``[N]``: per flat token (padding: no shift, no
    image row) and the image-token tables the step reads.

    ``rope_shift``: the multimodal RoPE positions minus the cache position (``rope_positions``; 0 for a plain text
    sequence). ``image_rows``, ``embeds``, ``deepstack``: the step's image tokens (None in a step without any): a
    placeholder token takes row ``image_rows[n]`` of ``embeds`` as its input embedding and adds that row of
    ``deepstack[i]`` after decoder layer i; -1 marks a text token. ``embeds`` and ``deepstack`` are the encoder's
    outputs as they lie on the device (a table of ``R`` rows): a step gathers its rows there, so the embeddings
    never travel through the host.
    """

    rope_shift: jax.Array | np.ndarray  # [N, 3] int32
    image_rows: jax.Array | np.ndarray | None = None  # [N] int32, -1: a text token
    embeds: jax.Array | np.ndarray | None = None  # [R, D]
    deepstack: jax.Array | np.ndarray | None = None  # [L, R, D]


@dataclasses.dataclass(eq=False)
class RequestImages:
    """A request's images placed in its prompt: where their tokens are, the prompt's multimodal positions, and
    (once the prefill encodes them, ``encoded``) their decoder-token embeddings, shared by the request's samples."""

    images: list[ImageInput]
    spans: list[tuple[int, int]]  # each image's (first, end) placeholder positions
    rope_positions: np.ndarray  # [prompt length, 3] int32
    rope_delta: int  # what every token after the prompt adds to its position on the three axes
    # Once encoded: the encoder call's outputs (on the device, shared by every request of the call), whose rows
    # first_row .. first_row + M are this request's image tokens in prompt order (M = the spans' total).
    embeds: jax.Array | None = None  # [R, D]
    deepstack: jax.Array | None = None  # [L, R, D]
    first_row: int = 0

    @classmethod
    def place(cls, prompt_ids: Sequence[int], images: Sequence[ImageInput], vision: VisionConfig) -> "RequestImages":
        """The images of the expanded prompt ``prompt_ids`` (ValueError unless each has its run of placeholders)."""
        spans = image_spans(list(prompt_ids), images, vision)
        positions, delta = rope_positions(len(prompt_ids), spans, [i.grid for i in images], vision.spatial_merge_size)
        return cls(list(images), spans, positions, delta)

    @property
    def end(self) -> int:
        """The position past the last image token: a chunk from here on reads no image rows."""
        return self.spans[-1][1]

    @property
    def encoded(self) -> bool:
        return self.embeds is not None

    def salt(self, first: int, end: int) -> str:
        """The digests of the images with tokens in positions [first, end), comma-separated ("" for none)."""
        return ",".join(i.digest for i, (a, b) in zip(self.images, self.spans, strict=True) if a < end and b > first)

    def rows(self, start: int, count: int) -> np.ndarray:
        """``[count]`` each position's row among this request's image tokens (``first_row + row`` of ``embeds``),
        for the positions [start, start + count); -1 for a text token."""
        rows = np.full(count, -1, np.int64)
        offset = 0
        for a, b in self.spans:
            lo, hi = max(a, start), min(b, start + count)
            if lo < hi:
                rows[lo - start:hi - start] = offset + np.arange(lo - a, hi - a)
            offset += b - a
        return rows

    def rope_shift(self, start: int, count: int) -> np.ndarray:
        """``[count, 3]``: the multimodal position minus the cache position of each position from ``start``."""
        positions = np.arange(start, start + count)
        shift = np.full((count, 3), self.rope_delta, np.int32)
        inside = positions < len(self.rope_positions)
        shift[inside] = self.rope_positions[positions[inside]] - positions[inside, None]
        return shift


def step_inputs(parts: Sequence[tuple[RequestImages | None, int, int]], num_tokens: int) -> MultimodalInputs | None:
    """The ``MultimodalInputs`` of a step whose chunks are ``parts`` ((images or None, start, count) each, their
    tokens flat in order, padded to ``num_tokens``); None when no chunk has images. Image rows index the encoded
    ``RequestImages``' tables, joined on the device where the step's images come from several encoder calls (a
    chunk holding image tokens of images not encoded: ValueError)."""
    if all(images is None for images, _, _ in parts):
        return None
    shift = np.zeros((num_tokens, 3), np.int32)
    image_rows = np.full(num_tokens, -1, np.int32)
    tables: dict[int, tuple[int, RequestImages]] = {}  # id(embeds) -> (its first row in the joined table, images)
    flat = 0
    for images, start, count in parts:
        if images is not None:
            shift[flat:flat + count] = images.rope_shift(start, count)
            chunk_rows = images.rows(start, count)
            inside = chunk_rows >= 0
            if inside.any():
                if not images.encoded:
                    raise ValueError(f"a step holds image tokens at positions {start}..{start + count - 1} of "
                                     "images not encoded yet: expected the prefill to encode them first")
                offset, _ = tables.setdefault(id(images.embeds),
                                              (sum(len(t.embeds) for _, t in tables.values()), images))
                image_rows[flat:flat + count][inside] = offset + images.first_row + chunk_rows[inside]
        flat += count
    if not tables:
        return MultimodalInputs(shift)
    sources = [images for _, images in tables.values()]
    if len(sources) == 1:
        return MultimodalInputs(shift, image_rows, sources[0].embeds, sources[0].deepstack)
    return MultimodalInputs(shift, image_rows, jnp.concatenate([t.embeds for t in sources]),
                            jnp.concatenate([t.deepstack for t in sources], axis=1))
