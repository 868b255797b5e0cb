"""An engine that produces its tokens instantly: for measuring what the serving path itself costs.

``benchmarks/front_door_ceiling.py`` serves it through the whole path (Serve proxy, ingress, engine replica)
in place of vLLM, so the tokens/s it reaches, and the CPU each process spends per token, belong to the path
alone. Its app answers chat and completions streams in vLLM's chunk format, one token per chunk.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from fleetserve.platform.config import ModelConfig
from fleetserve.platform.stats import EngineStats


class InstantEngine:
    """Stands in for ``Engine``: every request streams ``max_tokens`` tokens as fast as the loop runs."""

    block_size = 16
    num_pending_prompt_tokens = 0
    # Not an engine's limit: admission falls back to the config's, as for a replica that has not said.
    max_num_seqs = 0
    # Seconds between a request's tokens. 0 makes them as fast as the loop runs, and the replica then
    # coalesces many into each Ray item; an engine's step time (tens of ms) gives one token per item, as a
    # real engine streams them.
    step_s: ClassVar[float] = 0.0

    @classmethod
    def paced(cls, step_s: float) -> type[InstantEngine]:
        """This engine, making one token per request every ``step_s`` seconds."""
        return type("PacedInstantEngine", (cls,), {"step_s": step_s})

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._app = self._build_app()

    @classmethod
    def create(cls, model: ModelConfig, model_path: Path, cpu_binding: str | None = None, stats_listeners=(),
               **_: Any) -> InstantEngine:
        return cls(model.name)

    async def openai_app(self) -> Any:
        return self._app

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        async def serve(raw: Request, chat: bool) -> Any:
            body = json.loads(await raw.body())
            num_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
            head = {"id": f"x-{raw.headers.get('x-request-id', '')}", "object": "chat.completion.chunk" if chat
                    else "text_completion", "created": 0, "model": body["model"]}
            usage = {"prompt_tokens": 1, "completion_tokens": num_tokens, "total_tokens": 1 + num_tokens}
            if not body.get("stream"):
                choice = ({"index": 0, "message": {"role": "assistant", "content": " t" * num_tokens},
                           "finish_reason": "length"} if chat else
                          {"index": 0, "text": " t" * num_tokens, "finish_reason": "length"})
                return JSONResponse({**head, "choices": [choice], "usage": usage})

            async def events():
                for index in range(num_tokens):
                    finish = "length" if index == num_tokens - 1 else None
                    choice = ({"index": 0, "delta": {"content": " t"}, "finish_reason": finish} if chat
                              else {"index": 0, "text": " t", "finish_reason": finish})
                    yield f"data: {json.dumps({**head, 'choices': [choice]}, separators=(',', ':'))}\n\n"
                    await asyncio.sleep(self.step_s)  # one token per step, as an engine streams them
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage}, separators=(',', ':'))}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        @app.post("/v1/chat/completions")
        async def chat(raw: Request) -> Any:
            return await serve(raw, chat=True)

        @app.post("/v1/completions")
        async def completions(raw: Request) -> Any:
            return await serve(raw, chat=False)

        return app

    def stats(self) -> EngineStats:
        return EngineStats()

    @property
    def errored(self) -> bool:
        return False

    @property
    def num_unfinished_requests(self) -> int:
        return 0

    def num_generated_tokens(self, request_ids: Any) -> int:
        return 0  # answers at once: nothing to report before they are whole

    async def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
