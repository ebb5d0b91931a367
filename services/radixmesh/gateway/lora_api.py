"""LoRA adapter routes (SGLang's names): /load_lora_adapter, /unload_lora_adapter, /list_lora_adapters.

Loading checks the adapter against the base model (400 naming a mismatch: another model's shapes, a rank
above --max-lora-rank); it never fails a running request. Requests then name the adapter as `model:
"base:adapter"` or `model: "adapter"` (OpenAI) or `lora_path` (native /generate).
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


class UnloadLoraRequest(RequestBody):
    lora_name: str


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    req = parse_body(await request.body(), LoadLoraRequest)
    info = await get_state(request).backend.load_lora_adapter(req.lora_name, req.lora_path)
    return JSONResponse({"success": True, **info})


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    req = parse_body(await request.body(), UnloadLoraRequest)
    await get_state(request).backend.unload_lora_adapter(req.lora_name)
    return JSONResponse({"success": True, "lora_name": req.lora_name})


@router.get("/list_lora_adapters")
async def list_lora_adapters(request: Request) -> Response:
    return JSONResponse({"adapters": await get_state(request).backend.list_lora_adapters()})
