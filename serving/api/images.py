"""Image parts of API requests -> preprocessed images, within the server's limits.

OpenAI chat ``image_url`` parts carry a ``url``: a base64 data URL (``data:image/png;base64,...``), or an http(s)
link, which the server fetches only when started with ``ImageOptions.allow_remote`` (``--allow-remote-images``;
off by default: a server that makes no outbound requests cannot be made to reach hosts on its network). Anthropic
``image`` blocks carry a ``source``: ``{"type": "base64", "media_type", "data"}`` (or ``{"type": "url"}``, under
the same option). Every image is decoded with Pillow (PNG, JPEG, GIF, WebP, ... : the formats in
``MEDIA_TYPES``) and preprocessed as the model's processor config says (``serving.images``).

Refusals, each naming the part: a model without an image encoder (400), a URL that is neither (400), a remote URL
without the option (400), more than ``max_images`` images in a request (413), an image of more than
``max_bytes`` bytes or ``max_pixels`` pixels (413), data that is not an image (400).
"""

import dataclasses
import urllib.error
import urllib.request
from typing import Any

from serving.api.errors import APIError
from serving.images import (
    ImageError,
    ImageInput,
    ImageProcessorConfig,
    decode_base64,
    decode_image,
    preprocess,
    split_data_url,
)

MEDIA_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp", "image/bmp", "image/tiff")
FETCH_TIMEOUT_S = 10.0  # a remote image that does not arrive in this time is a 400


@dataclasses.dataclass(frozen=True)
class ImageOptions:
    """The server's image limits and whether it may fetch http(s) image URLs."""

    max_images: int = 8  # per request
    max_bytes: int = 20 * 1024 * 1024  # encoded, per image
    max_pixels: int = 32 * 1024 * 1024  # decoded, per image (before the processor resizes it)
    allow_remote: bool = False

    def __post_init__(self):
        for name in ("max_images", "max_bytes", "max_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"ImageOptions.{name} = {getattr(self, name)}: expected >= 1")


class ImageCollector:
    """Gathers one request's images in prompt order: ``openai_part`` / ``anthropic_source`` decode and preprocess
    each (with ``processor``: None for a model without an image encoder, which refuses every image)."""

    def __init__(self, options: ImageOptions, processor: ImageProcessorConfig | None, model: str):
        self.options, self.processor, self.model = options, processor, model
        self.images: list[ImageInput] = []

    def openai_part(self, url: str, where: str) -> None:
        """An OpenAI ``image_url.url``: a base64 data URL, or (allowed remote fetches) an http(s) URL."""
        self._check(where)
        if url.startswith(("http://", "https://")):
            data = self._fetch(url, where)
        else:
            try:
                media_type, encoded = split_data_url(url, where)
            except ImageError as e:
                raise APIError(400, f"{e}, or an http(s) URL", where) from None
            self._check_media_type(media_type, where)
            data = self._decode(encoded, where)
        self._add(data, where)

    def anthropic_source(self, source: dict[str, Any], where: str) -> None:
        """An Anthropic image block's ``source``: base64 (``media_type``, ``data``), or (allowed remote fetches) url."""
        self._check(where)
        kind = source.get("type")
        if kind == "base64":
            media_type, encoded = source.get("media_type"), source.get("data")
            if not isinstance(media_type, str) or not isinstance(encoded, str):
                raise APIError(400, f"{where}: a base64 image source needs 'media_type' and 'data' strings", where)
            self._check_media_type(media_type, where)
            data = self._decode(encoded, where)
        elif kind == "url" and isinstance(source.get("url"), str):
            data = self._fetch(source["url"], where)
        else:
            raise APIError(400, f"{where}: image source type {kind!r}: expected 'base64' (or 'url')", where)
        self._add(data, where)

    def _check(self, where: str) -> None:
        if self.processor is None:
            raise APIError(400, f"{where}: model {self.model!r} has no vision encoder: it reads text only (expected "
                           "no image parts)", where)
        if len(self.images) >= self.options.max_images:
            raise APIError(413, f"{where}: more than {self.options.max_images} images in one request", where)

    def _check_media_type(self, media_type: str, where: str) -> None:
        if media_type not in MEDIA_TYPES:
            raise APIError(400, f"{where}: media type {media_type!r}: expected one of {list(MEDIA_TYPES)}", where)

    def _decode(self, encoded: str, where: str) -> bytes:
        if len(encoded) > 4 * (self.options.max_bytes // 3 + 1):  # refused before decoding
            raise APIError(413, f"{where}: image of more than {self.options.max_bytes} bytes", where)
        try:
            data = decode_base64(encoded, where)
        except ImageError as e:
            raise APIError(e.status, str(e), where) from None
        if len(data) > self.options.max_bytes:
            raise APIError(413, f"{where}: image of {len(data)} bytes: expected at most {self.options.max_bytes}",
                           where)
        return data

    def _fetch(self, url: str, where: str) -> bytes:
        if not self.options.allow_remote:
            raise APIError(400, f"{where}: remote image URLs are not fetched by this server (it makes no outbound "
                           "requests unless started with --allow-remote-images): send the image as a base64 data "
                           "URL", where)
        try:
            with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:
                data = response.read(self.options.max_bytes + 1)
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise APIError(400, f"{where}: could not fetch the image at {url!r:.200}: {e}", where) from None
        if len(data) > self.options.max_bytes:
            raise APIError(413, f"{where}: image of more than {self.options.max_bytes} bytes", where)
        return data

    def _add(self, data: bytes, where: str) -> None:
        try:
            image = decode_image(data, self.options.max_pixels)
            self.images.append(preprocess(image, self.processor))
        except ImageError as e:
            raise APIError(e.status, f"{where}: {e}", where) from None
