"""`radixmesh serve`'s front end over a stub scheduler: what the front end itself costs per request.

The real HTTP app, `LocalEngineBackend` and `EngineClient` (validation, admission, detokenization, metrics) run as in
`serve`; only the scheduler process is replaced by a stub in the same process that answers every request with
its first token after `--ttft-ms` and the rest `--itl-ms` apart (as many as the request asks for). A benchmark
against it measures the front end's own time to first token, e.g. the text workload against the token-id one:

    python scripts/stub_serve.py --model DIR --port 8400 &
    radixmesh bench serving --port 8400 --backend sglang --workload random --random-input-len 4096 ...

It imports nothing new from the tree, so the same script measures an older checkout (PYTHONPATH) too, from
before the engine's modules moved (`engine.messages`, `engine.tokenizer`, `LocalBackend`) as well as after.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import uvicorn

from radixmesh.engine.client import EngineClient
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.loader import prepare_model
from radixmesh.gateway.app import create_app
from radixmesh.gateway.config import GatewayConfig

try:
    from radixmesh.engine.hf_tokenizer import load_tokenizer
    from radixmesh.gateway.local_backend import LocalEngineBackend
    from radixmesh.wire.messages import TokenOut
except ImportError:  # a tree from before the modules moved
    from radixmesh.engine.messages import TokenOut  # type: ignore[no-redef]
    from radixmesh.engine.tokenizer import load_tokenizer  # type: ignore[no-redef]
    from radixmesh.gateway.local_backend import LocalBackend as LocalEngineBackend  # type: ignore[no-redef]


class StubEngineClient(EngineClient):
    """EngineClient whose requests are answered in this process: token 42, `ttft_s` then `itl_s` apart."""

    def __init__(self, prepared: Any, tokenizer: Any, ttft_s: float, itl_s: float) -> None:
        super().__init__(EngineConfig(device="cpu"), prepared, tokenizer)
        self._ctx.destroy(linger=0)  # no scheduler process: its sockets are never used
        self.server_info = {"max_running_requests": 1024}
        self.ttft_s, self.itl_s = ttft_s, itl_s

    @property
    def is_alive(self) -> bool:
        return True

    async def _stream(self, msg: Any) -> AsyncGenerator[Any, None]:
        prompt_len, wanted = len(msg.input_ids), max(1, msg.params.max_new_tokens)
        await asyncio.sleep(self.ttft_s)
        for i in range(wanted):
            if i:
                await asyncio.sleep(self.itl_s)
            yield TokenOut(msg.rid, [42], prompt_len, 0, i + 1, finish_reason="length" if i + 1 == wanted else None)

    async def abort(self, rid: str) -> None:
        return None

    async def get_server_info(self) -> dict[str, Any]:
        return dict(self.server_info)

    async def shutdown(self) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model directory (only its config and tokenizer are read)")
    parser.add_argument("--port", type=int, default=8400)
    parser.add_argument("--ttft-ms", type=float, default=1.0, help="the stub engine's time to a first token")
    parser.add_argument("--itl-ms", type=float, default=10.0, help="the stub engine's time between tokens")
    args = parser.parse_args()
    prepared = prepare_model(args.model, "dummy")
    assert prepared.tokenizer_path is not None, f"{args.model} has no tokenizer"
    client = StubEngineClient(prepared, load_tokenizer(prepared.tokenizer_path), args.ttft_ms / 1e3, args.itl_ms / 1e3)
    app = create_app(LocalEngineBackend(client), GatewayConfig(port=args.port))
    print(f"stub serve on http://127.0.0.1:{args.port}", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
