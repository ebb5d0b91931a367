"""Image sources as clients send them -> decoded RGB images, under `ImageLimits`.

Accepted: base64 `data:` URLs (OpenAI `image_url`), bare base64 strings and raw bytes (SGLang's
`image_data`), and http(s) URLs only when `allow_remote_images` is set (size and time limited).
Every failure is one INVALID_ARGUMENT naming the request part it came from.
"""

from __future__ import annotations

import base64
import binascii
import io
import time
import warnings
from typing import TYPE_CHECKING

from radixmesh.common.errors import RadixMeshError, invalid_argument
from radixmesh.engine.mm.config import ImageLimits
from radixmesh.wire.images import ImageSource

if TYPE_CHECKING:
    from PIL import Image


def load_image(source: ImageSource, limits: ImageLimits) -> Image.Image:
    """The image as RGB, decoded once its header passed the pixel limit."""
    raw = source.data if source.data is not None else _read_url(source, limits)
    if len(raw) > limits.max_image_bytes:
        raise invalid_argument(f"{source.part}: the image has {len(raw)} bytes; at most {limits.max_image_bytes} "
                               "are accepted (--max-image-bytes)", source.part)
    return _decode(raw, source.part, limits)


def _read_url(source: ImageSource, limits: ImageLimits) -> bytes:
    url = (source.url or "").strip()
    if not url:
        raise invalid_argument(f"{source.part}: the image is empty", source.part)
    if url.startswith("data:"):
        return _data_url(url, source.part, limits)
    if url.startswith(("http://", "https://")):
        if not limits.allow_remote_images:
            raise invalid_argument(f"{source.part}: http(s) image URLs are not fetched by this server (start it with "
                                   "--allow-remote-images); send the image as a base64 data: URL", source.part)
        return _fetch(url, source.part, limits)
    if "://" in url[:16]:
        raise invalid_argument(f"{source.part}: unsupported image URL scheme {url.split('://')[0]!r}; use a base64 "
                               "data: URL", source.part)
    return _b64(url, source.part, limits)


def _data_url(url: str, part: str, limits: ImageLimits) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise invalid_argument(f"{part}: malformed data: URL (no ',' before the data)", part)
    if not header.endswith(";base64"):
        raise invalid_argument(f"{part}: a data: URL image must be base64-encoded (data:image/png;base64,...)", part)
    media = header[len("data:"):-len(";base64")].split(";")[0].strip().lower()
    if media and not media.startswith("image/") and media != "application/octet-stream":
        raise invalid_argument(f"{part}: the data: URL holds {media!r}, not an image", part)
    return _b64(payload, part, limits)


def _b64(text: str, part: str, limits: ImageLimits) -> bytes:
    if len(text) > limits.max_image_bytes * 4 // 3 + 8:
        raise invalid_argument(f"{part}: the image is larger than {limits.max_image_bytes} bytes "
                               "(--max-image-bytes)", part)
    compact = "".join(text.split())
    try:
        return base64.b64decode(compact + "=" * (-len(compact) % 4), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise invalid_argument(f"{part}: broken base64 image data ({exc})", part) from None


def _fetch(url: str, part: str, limits: ImageLimits) -> bytes:
    import httpx

    deadline = time.monotonic() + limits.remote_image_timeout_s
    chunks: list[bytes] = []
    size = 0
    try:
        with httpx.stream("GET", url, timeout=limits.remote_image_timeout_s, follow_redirects=True) as response:
            if response.status_code != 200:
                raise invalid_argument(f"{part}: fetching the image failed with HTTP {response.status_code}", part)
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > limits.max_image_bytes:
                    raise invalid_argument(f"{part}: the image at the URL is larger than {limits.max_image_bytes} "
                                           "bytes (--max-image-bytes)", part)
                if time.monotonic() > deadline:
                    raise invalid_argument(f"{part}: fetching the image took longer than "
                                           f"{limits.remote_image_timeout_s:g} s", part)
                chunks.append(chunk)
    except httpx.HTTPError as exc:
        raise invalid_argument(f"{part}: cannot fetch the image: {type(exc).__name__}: {exc}", part) from None
    return b"".join(chunks)


def _decode(raw: bytes, part: str, limits: ImageLimits) -> Image.Image:
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw))
            width, height = image.size
            if width * height > limits.max_image_pixels:
                raise invalid_argument(f"{part}: the image has {width}x{height} = {width * height} pixels; at most "
                                       f"{limits.max_image_pixels} are accepted (--max-image-pixels)", part)
            image.load()
    except RadixMeshError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        if isinstance(exc, UnidentifiedImageError):
            raise invalid_argument(f"{part}: not an image (no known image format in {len(raw)} bytes)", part) from None
        raise invalid_argument(f"{part}: the image has too many pixels ({exc})", part) from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise invalid_argument(f"{part}: corrupt image ({type(exc).__name__}: {exc})", part) from None
    if width < 1 or height < 1:
        raise invalid_argument(f"{part}: the image is empty ({width}x{height})", part)
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with transparency composited onto white (as Hugging Face processors convert)."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def image_sources(image_data: str | bytes | list[str | bytes] | None, param: str) -> list[ImageSource]:
    """SGLang's `image_data` of one prompt (one image or a list) as sources named `param[i]`."""
    if image_data is None:
        return []
    items = image_data if isinstance(image_data, list) else [image_data]
    sources = []
    for i, item in enumerate(items):
        part = f"{param}[{i}]" if isinstance(image_data, list) else param
        if isinstance(item, bytes | bytearray):
            sources.append(ImageSource(part, data=bytes(item)))
        elif isinstance(item, str):
            sources.append(ImageSource(part, url=item))
        else:
            raise invalid_argument(f"{part}: an image must be a base64 string, a data: URL or an http(s) URL", part)
    return sources
