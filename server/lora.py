"""LoRA adapters as the API process sees them: vLLM's flags, and which adapter a request
names in `model`.

`--enable-lora` with `--lora-modules name=path ...` serves each PEFT folder under its
name beside the base model; `--max-loras` adapters may share a step, `--max-lora-rank`
bounds their rank, `--max-cpu-loras` how many stay loaded (model_runner/config.py's
`LoRAConfig`). A request names an adapter in `model`; /v1/models lists each with the
base model as its `parent`.

With `--enable-runtime-lora-updating` (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING), POST
/v1/load_lora_adapter {"lora_name", "lora_path"} serves a new adapter (its folder
checked by the core: a 400 naming why not) and POST /v1/unload_lora_adapter
{"lora_name"} stops serving one (404 unknown, 400 while requests use it); with a
tenants file only an `admin` tenant may call them.
"""

from __future__ import annotations

import argparse

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from engine.client import EngineClient
from model_runner.config import LoRAConfig
from server.admission import Admission
from server.errors import APIError


class LoadLoRAAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=256)


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """The LoRA flags of `pagedserve serve` (vLLM's names)."""
    lora = parser.add_argument_group("LoRA adapters")
    lora.add_argument("--enable-lora", action="store_true",
                      help="serve LoRA adapters (PEFT folders) beside the base model")
    lora.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                      help="adapters served from the start: a request names one in `model`")
    lora.add_argument("--max-loras", type=int, default=1,
                      help="distinct adapters in one step, given to the most urgent "
                      "requests' adapters (default 1)")
    lora.add_argument("--max-lora-rank", type=int, default=16,
                      help="the largest adapter rank accepted (default 16)")
    lora.add_argument("--max-cpu-loras", type=int, default=None,
                      help="adapters kept loaded (default: --max-loras); the least recently "
                      "used of the least urgent is evicted first")
    lora.add_argument("--enable-runtime-lora-updating", action="store_true",
                      help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as "
                      "vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)")


def lora_config(args: argparse.Namespace) -> LoRAConfig | None:
    """The LoRA config of parsed flags (None without --enable-lora); ValueError naming a
    bad flag."""
    if not args.enable_lora:
        if args.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    modules = []
    for item in args.lora_modules or ():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {item!r}: expected NAME=PATH")
        modules.append((name, path))
    return LoRAConfig(modules=tuple(modules), max_loras=args.max_loras,
                      max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras)


def install_lora_routes(app: FastAPI, admission: Admission) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies and
    answers) over `admission`'s engine and its names of the adapters served."""

    async def update(raw: Request, name: str, path: str | None) -> PlainTextResponse:
        tenant = getattr(raw.state, "tenant", None)
        if tenant is not None and not tenant.is_admin:
            raise APIError(403, f"Tenant {tenant.name!r} may not change the LoRA adapters: "
                           "it needs `admin: true` in the tenants file.")
        engine = admission.engine
        if admission.engine.info.loras is None or not isinstance(engine, EngineClient):
            raise APIError(400, "LoRA adapters are not updated at run time here: start one "
                           "engine with --enable-lora.")
        if path is not None and (name in admission.loras or name in admission.model_names):
            raise APIError(400, f"The model or LoRA adapter `{name}` is already served.",
                           param="lora_name")
        error = await engine.update_lora(name, path)
        if error is not None:
            status = 404 if error.endswith("cannot be found.") else 400
            raise APIError(status, error, param="lora_name" if status == 404 else "lora_path")
        if path is None:
            del admission.loras[name]
            return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
        admission.loras[name] = path
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw: Request) -> PlainTextResponse:
        body = await admission.parse_json(raw, LoadLoRAAdapter)
        return await update(raw, body.lora_name, body.lora_path)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw: Request) -> PlainTextResponse:
        body = await admission.parse_json(raw, UnloadLoRAAdapter)
        if body.lora_name not in admission.loras:
            raise APIError(404, f"The LoRA adapter `{body.lora_name}` cannot be found.",
                           param="lora_name")
        return await update(raw, body.lora_name, None)
