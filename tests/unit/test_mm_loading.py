"""Reading images at the edge: every bad input is one 400 naming the part; remote fetches are opt-in,
size and time limited."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.engine.mm.config import ImageLimits
from radixmesh.engine.mm.loading import image_sources, load_image
from radixmesh.engine.mm.processors import ClipImageProcessor
from radixmesh.engine.mm.prompt import MultimodalProcessor
from radixmesh.engine.mm.spec import VisionSpec
from radixmesh.wire.images import ImageSource


def _png(width: int = 20, height: int = 10) -> bytes:
    buf = io.BytesIO()
    pixels = np.random.default_rng(width * height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def _error(source: ImageSource, limits: ImageLimits | None = None) -> RadixMeshError:
    with pytest.raises(RadixMeshError) as info:
        load_image(source, limits or ImageLimits())
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert info.value.param == source.part and info.value.message.startswith(source.part)
    return info.value


PART = "messages[0].content[1].image_url"


def test_valid_sources_decode_to_rgb() -> None:
    png = _png()
    for source in (ImageSource(PART, url=_url(png)), ImageSource(PART, url=base64.b64encode(png).decode()),
                   ImageSource(PART, data=png), ImageSource(PART, url=_url(png, "application/octet-stream"))):
        image = load_image(source, ImageLimits())
        assert image.mode == "RGB" and image.size == (20, 10)


@pytest.mark.parametrize(("url", "mention"), [
    (_url(b"this is not an image at all"), "not an image"),
    ("data:image/png;base64,%%%not-base64%%%", "broken base64"),
    ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAA", "corrupt image"),  # a truncated PNG
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    ("data:image/png,rawbytes", "base64-encoded"),
    ("ftp://example.com/cat.png", "scheme"),
    ("http://127.0.0.1:9/cat.png", "--allow-remote-images"),
    ("", "empty"),
])
def test_bad_image_sources_are_clear_400s(url: str, mention: str) -> None:
    assert mention in _error(ImageSource(PART, url=url)).message


def test_too_many_pixels_is_refused_from_the_header() -> None:
    error = _error(ImageSource(PART, data=_png(200, 100)), ImageLimits(max_image_pixels=100 * 100))
    assert "20000 pixels" in error.message and "--max-image-pixels" in error.message


def test_too_many_bytes_is_refused() -> None:
    error = _error(ImageSource(PART, url=_url(_png(64, 64))), ImageLimits(max_image_bytes=50))
    assert "--max-image-bytes" in error.message


def test_too_many_images_names_the_first_one_over() -> None:
    spec = VisionSpec("llava", 7, (), "\n", "clip", 1, {})
    processor = MultimodalProcessor(spec, ClipImageProcessor({}, 1), ImageLimits(max_images_per_request=2))
    sources = image_sources([_url(_png())] * 3, "image_data")
    with pytest.raises(RadixMeshError) as info:
        processor.load(sources)
    assert info.value.param == "image_data[2]" and "3 images" in info.value.message
    with pytest.raises(RadixMeshError, match="2 image placeholders"):
        processor.prepare_ids([1, 7, 7, 2], sources[:1])


class _ImageHandler(http.server.BaseHTTPRequestHandler):
    body = b""
    delay_s = 0.0

    def do_GET(self) -> None:
        time.sleep(self.delay_s)
        self.send_response(200 if self.path == "/cat.png" else 404)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # clients that give up mid-body (the size and time limits) are the point


@pytest.fixture()
def image_server() -> Iterator[str]:
    server = _QuietServer(("127.0.0.1", 0), _ImageHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_remote_images_are_fetched_only_when_allowed_and_within_limits(image_server: str) -> None:
    _ImageHandler.body, _ImageHandler.delay_s = _png(30, 30), 0.0
    allowed = ImageLimits(allow_remote_images=True)
    assert load_image(ImageSource(PART, url=f"{image_server}/cat.png"), allowed).size == (30, 30)
    assert "--allow-remote-images" in _error(ImageSource(PART, url=f"{image_server}/cat.png")).message
    assert "HTTP 404" in _error(ImageSource(PART, url=f"{image_server}/dog.png"), allowed).message
    small = ImageLimits(allow_remote_images=True, max_image_bytes=100)
    assert "larger than 100 bytes" in _error(ImageSource(PART, url=f"{image_server}/cat.png"), small).message
    _ImageHandler.delay_s = 1.0
    quick = ImageLimits(allow_remote_images=True, remote_image_timeout_s=0.2)
    assert "cannot fetch" in _error(ImageSource(PART, url=f"{image_server}/cat.png"), quick).message


def test_limits_are_checked_when_built() -> None:
    with pytest.raises(RadixMeshError, match="max_image_pixels"):
        ImageLimits(max_image_pixels=0)
    with pytest.raises(RadixMeshError, match="remote_image_timeout_s"):
        ImageLimits(remote_image_timeout_s=0)
