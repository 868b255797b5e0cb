"""An OpenAI-style streaming server with a known schedule, to check the load tester's clock.

Each request streams ``max_tokens`` one-token chunks: the first after --first-ms, then one every
--itl-ms. A prompt containing FAIL gets HTTP 500; one containing NOUSAGE gets no usage chunk; one containing
CUT stops after its content, without usage or `data: [DONE]` (a server that died mid-stream). Run: python schedule_server.py --port P ...
"""

import argparse
import asyncio
import json

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


def build(first_s: float, itl_s: float) -> Starlette:
    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "schedule", "object": "model"}]})

    async def generate(request: Request):
        body = await request.json()
        chat = request.url.path.endswith("chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if "BUSY" in prompt:
            return JSONResponse({"error": {"message": "at capacity", "type": "service_unavailable"}},
                                status_code=503, headers={"Retry-After": "2"})
        if "FAIL" in prompt:
            return JSONResponse({"error": {"message": "asked to fail", "type": "internal_error"}}, status_code=500)
        num_tokens = int(body["max_tokens"])

        async def stream():
            loop = asyncio.get_running_loop()
            start = loop.time()
            for index in range(num_tokens):
                # Sleep to an absolute schedule so delays do not accumulate.
                await asyncio.sleep(max(0.0, start + first_s + index * itl_s - loop.time()))
                choice = ({"index": 0, "delta": {"content": f"t{index} "}} if chat else
                          {"index": 0, "text": f"t{index} "})
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            if "CUT" in prompt:
                return
            if "NOUSAGE" not in prompt:
                usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": num_tokens,
                         "total_tokens": len(prompt.split()) + num_tokens}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"x-fleetserve-replica": "sched-0"})

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", generate, methods=["POST"]),
                             Route("/v1/chat/completions", generate, methods=["POST"])])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--first-ms", type=float, default=100)
    parser.add_argument("--itl-ms", type=float, default=10)
    args = parser.parse_args()
    uvicorn.run(build(args.first_ms / 1000, args.itl_ms / 1000), host="127.0.0.1", port=args.port, log_level="warning")
