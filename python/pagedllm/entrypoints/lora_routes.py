"""LoRA adapters loaded and unloaded while serving: vLLM's `POST /v1/load_lora_adapter`
`{"lora_name", "lora_path", "load_inplace"}` and `POST /v1/unload_lora_adapter` `{"lora_name"}`.

Allowed only on a server started with `--enable-lora` and the opt-in (`--allow-runtime-lora-
updating`, or `PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=1` as vLLM's `VLLM_ALLOW_RUNTIME_LORA_
UPDATING`); without the opt-in both routes answer 404 (vLLM does not register them), naming
what turns them on.

A load reads and checks the adapter's folder in a worker thread (the engine keeps stepping),
then hands the read adapter to the engine between two steps, under an id never used before (so
no prefix-cache entry of an earlier adapter is ever reused); the name is in `/v1/models` once
the call returned. A load that fails changes nothing. An unload removes the name at once (new
requests naming it get 404); requests already running with it finish with it, and its weights
are freed once they have (`LoRAManager.retire`): an unload never waits, nor is refused.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedllm.entrypoints.errors import APIError, ErrorResponse, unavailable
from pagedllm.executor.errors import EngineDeadError
from pagedllm.lora.request import LoRARequest

ENV_FLAG = "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING"
_RESPONSES = {
    200: {"description": "A line saying it succeeded", "content": {"text/plain": {}}},
    "4XX": {"model": ErrorResponse, "description": "A client error (the field named)"},
}


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    # replace an adapter of that name (its running requests finish with the old weights)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's body has it: when given it must be the name's id


def runtime_lora_updating_allowed(option: bool) -> bool:
    """The opt-in: the server option, or the env var set to 1 / true (as vLLM reads its own)."""
    return option or os.environ.get(ENV_FLAG, "0").strip().lower() in ("1", "true")


class RuntimeLoRAs:
    """The server's adapters by name (`server.loras`), changed one call at a time."""

    def __init__(self, server) -> None:
        self.server = server
        self.allowed = runtime_lora_updating_allowed(server.config.allow_runtime_lora_updating)
        self.lock = asyncio.Lock()
        # ids only grow: an id names one adapter for the engine's lifetime
        self.next_id = max((r.lora_int_id for r in server.loras.values()), default=0) + 1

    def manager(self):
        """The engine's LoRAManager; 404 without the opt-in, 400 without --enable-lora."""
        if not self.allowed:
            raise APIError(
                404,
                "loading LoRA adapters at run time is off: start the server with --enable-lora "
                f"and --allow-runtime-lora-updating (or {ENV_FLAG}=1)",
                type_="NotFoundError",
            )
        lora = getattr(self.server.engine.engine, "lora", None)
        if lora is None:
            raise APIError(400, "this server was started without --enable-lora")
        return lora

    async def load(self, body: LoadLoRAAdapterRequest) -> str:
        manager = self.manager()
        name, path = body.lora_name, body.lora_path
        async with self.lock:
            old = self._check_new_name(name, body.load_inplace)
            if not Path(path).is_dir():
                raise APIError(
                    404,
                    f"LoRA adapter {name!r}: no such folder {path!r}",
                    param="lora_path",
                    type_="NotFoundError",
                )
            request = LoRARequest(name, self.next_id, path)
            self.next_id += 1
            try:  # the folder is read and checked off the engine thread
                adapter = await asyncio.to_thread(manager.read, request)
            except ValueError as exc:
                raise APIError(400, str(exc), param="lora_path") from None
            await self._in_engine(lambda engine: engine.lora.install(request, adapter))
            self.server.loras[name] = request
            if old is not None:
                await self._in_engine(lambda engine: engine.lora.retire(old.lora_int_id))
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        self.manager()
        name = body.lora_name
        async with self.lock:
            request = self.server.loras.get(name)
            if request is None:
                raise APIError(
                    404,
                    f"The lora adapter '{name}' cannot be found.",
                    param="lora_name",
                    type_="NotFoundError",
                )
            if body.lora_int_id is not None and body.lora_int_id != request.lora_int_id:
                raise APIError(
                    400,
                    f"lora_int_id={body.lora_int_id} is not the id of adapter '{name}' "
                    f"({request.lora_int_id})",
                    param="lora_int_id",
                )
            del self.server.loras[name]  # at once: new requests naming it get 404
            await self._in_engine(lambda engine: engine.lora.retire(request.lora_int_id))
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _check_new_name(self, name: str, inplace: bool) -> LoRARequest | None:
        """The adapter `name` replaces (only with `load_inplace`); 400 for a taken name."""
        if name == self.server.model_name:
            raise APIError(400, f"lora_name {name!r} is the base model's name", param="lora_name")
        old = self.server.loras.get(name)
        if old is not None and not inplace:
            raise APIError(
                400,
                f"The lora adapter '{name}' has already been loaded (unload it first, or load "
                f"with load_inplace=true)",
                param="lora_name",
            )
        return old

    async def _in_engine(self, call) -> None:
        try:
            await self.server.engine.between_steps(call)
        except EngineDeadError as exc:
            raise unavailable(str(exc)) from None


def register_lora_routes(app: FastAPI, server) -> None:
    """Adds the two routes to `app` (listed in /openapi.json only where they are allowed)."""
    loras = RuntimeLoRAs(server)

    def documented(model: type[BaseModel]) -> dict:
        schema = model.model_json_schema()
        body = {"required": True, "content": {"application/json": {"schema": schema}}}
        return dict(
            responses=_RESPONSES,
            include_in_schema=loras.allowed,
            openapi_extra={"requestBody": body},
        )

    @app.post("/v1/load_lora_adapter", **documented(LoadLoRAAdapterRequest))
    async def load_lora_adapter(request: Request):
        loras.manager()  # without the opt-in every body is a 404, as where vLLM has no route
        body = await _parse(request, LoadLoRAAdapterRequest)
        return PlainTextResponse(await loras.load(body))

    @app.post("/v1/unload_lora_adapter", **documented(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(request: Request):
        loras.manager()  # without the opt-in every body is a 404, as where vLLM has no route
        body = await _parse(request, UnloadLoRAAdapterRequest)
        return PlainTextResponse(await loras.unload(body))


async def _parse(request: Request, model: type[BaseModel]):
    """The body as `model`; a 400 naming the first bad field (its own names, which the shared
    protocol's field list does not hold)."""
    try:
        data = json.loads(await request.body())
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = [(e.get("loc") or ("body",), e["msg"]) for e in exc.errors()]
        message = "; ".join(f"{loc[0]}: {msg}" for loc, msg in problems[:5])
        first = str(problems[0][0][0])
        raise APIError(400, message, param=None if first == "body" else first) from None
