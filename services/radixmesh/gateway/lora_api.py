"""LoRA adapter routes (SGLang's names): /load_lora_adapter, /unload_lora_adapter, /list_lora_adapters.

Loading checks the adapter against the base model (400 naming a mismatch: another model's shapes, a rank
above --max-lora-rank); it never fails a running request. A cluster gateway loads on every worker serving adapters
and unloads from every worker holding one, or on the one `worker_id` names (radixmesh.router.lora_control).
Requests then name the adapter as `model: "base:adapter"` or `model: "adapter"` (OpenAI) or `lora_path` (native
/generate).
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixmesh.gateway.protocol import RequestBody, parse_body
from radixmesh.gateway.state import get_state

router = APIRouter(tags=["lora"])


class LoadLoraRequest(RequestBody):
    lora_name: str
    lora_path: str
    worker_id: str = ""
    """A cluster gateway: load on this worker only (default: every worker serving adapters)."""


class UnloadLoraRequest(RequestBody):
    lora_name: str
    worker_id: str = ""
    """A cluster gateway: unload from this worker only (default: every worker holding it)."""


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    req = parse_body(await request.body(), LoadLoraRequest)
    info = await get_state(request).backend.load_lora_adapter(req.lora_name, req.lora_path, req.worker_id)
    return JSONResponse({"success": True, **info})


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    req = parse_body(await request.body(), UnloadLoraRequest)
    info = await get_state(request).backend.unload_lora_adapter(req.lora_name, req.worker_id)
    return JSONResponse({"success": True, "lora_name": req.lora_name, **info})


@router.get("/list_lora_adapters")
async def list_lora_adapters(request: Request) -> Response:
    return JSONResponse({"adapters": await get_state(request).backend.list_lora_adapters()})
