"""A fake engine for serving-logic tests: a tiny OpenAI-shaped app that emits ``w0 w1 ...`` on a fixed
schedule, standing in for vLLM's app over an AsyncLLM. Injected through ``EngineServer(engine_cls=...)``."""

from __future__ import annotations

import asyncio
import json
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from fleetserve.platform.progress import note_request
from fleetserve.platform.stats import EngineStats


class FakeTokenizer:
    """Whitespace tokenizer over a fixed vocabulary."""

    def __init__(self, vocab_size: int = 1000) -> None:
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [hash(word) % self.vocab_size for word in text.split()]


# What vLLM's stream generators send when the engine dies under them (create_streaming_error_response of its
# EngineDeadError, a VLLMServerError).
VLLM_ENGINE_DEAD_EVENT = {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root "
                                               "cause.", "type": "InternalServerError", "param": None, "code": 500}}

# What vLLM's Anthropic Messages stream ends with when its engine dies: its converter fails to parse the chat
# error event above (measured on vLLM 0.32, killing the engine core under a served /v1/messages stream).
VLLM_MESSAGES_ENGINE_DEAD_EVENT = {"type": "error", "error": {
    "type": "internal_error",
    "message": "2 validation errors for ChatCompletionStreamResponse\nmodel\n  Field required"}}


class FakeEngineDeadError(RuntimeError):
    """What vLLM's Responses stream raises mid-body when its engine dies (no error event; measured as above)."""


def _error(message: str, param: str | None = None, status: int = 400) -> JSONResponse:
    # vLLM's error body shape.
    return JSONResponse({"error": {"message": message, "type": "BadRequestError", "param": param, "code": status}},
                        status_code=status)


class FakeEngine:
    """``first_token_s`` is the delay before the first token, ``token_interval_s`` between tokens."""

    first_token_s = 0.0
    token_interval_s = 0.0
    max_model_len = 64
    # What the engine reports as its max_num_seqs; 0 (not said) leaves admission to the config's.
    max_num_seqs = 0
    # Set by a test: the engine core dies after this many tokens of a stream, which vLLM ends with its error.
    die_after_tokens: int | None = None
    # With die_after_tokens: the app raises mid-stream, as vLLM's Responses stream does, instead of sending an
    # error event.
    die_by_raising = False

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.aborted: list[str] = []
        self.running: set[str] = set()
        # Tokens generated so far by each running request.
        self.generated: dict[str, int] = {}
        self.num_finished = 0
        self.num_pending_prompt_tokens = 0
        # Every body the app received, parsed, in arrival order.
        self.bodies: list[dict] = []
        # Each generating request's priority as vLLM reads it: its priority header, else the body's, else 0.
        self.priorities: list[int] = []
        # Set by a test to play a dead engine core.
        self.errored = False
        self._app = self._build_app()

    @classmethod
    def create(cls, model, model_path, cpu_binding=None, stats_listeners=(), **_) -> FakeEngine:
        return cls()

    async def openai_app(self):
        return self._app

    def _received(self, raw: Request, body: dict) -> None:
        self.bodies.append(body)
        header = raw.headers.get("x-vllm-priority")
        self.priorities.append(int(header) if header is not None else body.get("priority", 0))

    def _prompt_ids(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if isinstance(messages, list):
            return self.tokenizer.encode(" ".join(str(m.get("content") or "") for m in messages if isinstance(m, dict)))
        prompt = body.get("prompt", "")
        if isinstance(prompt, list):
            return [token if isinstance(token, int) else -1 for token in prompt]
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else []

    async def _tokens(self, request_id: str, num_prompt: int, max_tokens: int, stop: list[str]):
        """Yields (text, finish_reason) per token; aborts count when the consumer leaves early."""
        self.running.add(request_id)
        note_request(request_id)
        self.num_pending_prompt_tokens += num_prompt
        pending = num_prompt
        finished = False
        try:
            await asyncio.sleep(self.first_token_s)
            self.num_pending_prompt_tokens -= pending
            pending = 0
            for index in range(max_tokens):
                if index:
                    await asyncio.sleep(self.token_interval_s)
                word = f"w{index}"
                if word in stop:
                    finished = True
                    yield "", "stop"
                    return
                last = index == max_tokens - 1
                finished = last
                self.generated[request_id] = index + 1
                yield (f" {word}" if index else word), ("length" if last else None)
        finally:
            self.num_pending_prompt_tokens -= pending
            self.running.discard(request_id)
            self.generated.pop(request_id, None)
            self.num_finished += 1
            if not finished:
                self.aborted.append(request_id)

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        async def generate(raw: Request, chat: bool):
            body = json.loads(await raw.body())
            self._received(raw, body)
            prompt = self._prompt_ids(body)
            if not prompt:
                return _error("The decoder prompt cannot be empty", "prompt")
            if any(not 0 <= token < len(self.tokenizer) for token in prompt):
                return _error("prompt token ids are outside the vocabulary", "prompt")
            requested = body.get("max_completion_tokens") or body.get("max_tokens")
            if requested is not None and (not isinstance(requested, int) or requested < 1):
                return _error("max_tokens must be a positive integer", "max_tokens")
            max_tokens = requested if requested is not None else (16 if not chat else self.max_model_len - len(prompt))
            if len(prompt) + max_tokens > self.max_model_len:
                return _error(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                              f"requested {len(prompt) + max_tokens} tokens", "max_tokens")
            stop = body.get("stop") or []
            stop = [stop] if isinstance(stop, str) else stop
            request_id = raw.headers.get("x-request-id", uuid.uuid4().hex)
            response_id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
            obj = "chat.completion" if chat else "text_completion"
            tokens = self._tokens(request_id, len(prompt), max_tokens, stop)

            def usage(count: int) -> dict:
                return {"prompt_tokens": len(prompt), "completion_tokens": count,
                        "total_tokens": len(prompt) + count}

            if body.get("stream"):
                async def events():
                    count = 0
                    async for text, finish in tokens:
                        if count == self.die_after_tokens:
                            self.errored = True
                            if self.die_by_raising:
                                raise FakeEngineDeadError("EngineCore encountered an issue")
                            yield f"data: {json.dumps(VLLM_ENGINE_DEAD_EVENT)}\n\n"
                            yield "data: [DONE]\n\n"
                            return
                        count += bool(text)
                        delta = ({"role": "assistant", "content": text} if count <= 1 else {"content": text})
                        choice = ({"index": 0, "delta": delta, "finish_reason": finish} if chat
                                  else {"index": 0, "text": text, "finish_reason": finish})
                        yield f"data: {json.dumps({'id': response_id, 'object': obj + ('.chunk' if chat else ''), 'model': body['model'], 'choices': [choice]})}\n\n"
                    if (body.get("stream_options") or {}).get("include_usage"):
                        yield f"data: {json.dumps({'id': response_id, 'object': obj, 'model': body['model'], 'choices': [], 'usage': usage(count)}, separators=(',', ':'))}\n\n"
                    yield "data: [DONE]\n\n"

                return StreamingResponse(events(), media_type="text/event-stream")
            texts, finish = [], None
            async for text, finish in tokens:
                texts.append(text)
            content = "".join(texts)
            choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}
                      if chat else {"index": 0, "text": content, "finish_reason": finish})
            return JSONResponse({"id": response_id, "object": obj, "model": body["model"], "choices": [choice],
                                 "usage": usage(sum(1 for t in texts if t))})

        @app.post("/v1/chat/completions")
        async def chat(raw: Request):
            return await generate(raw, chat=True)

        @app.post("/v1/completions")
        async def completions(raw: Request):
            return await generate(raw, chat=False)

        @app.post("/v1/messages")
        async def messages(raw: Request):
            """Anthropic's Messages API, streamed only: one text block of max_tokens words."""
            body = json.loads(await raw.body())
            self._received(raw, body)
            tokens = self._tokens(raw.headers.get("x-request-id", uuid.uuid4().hex), len(self._prompt_ids(body)),
                                  body["max_tokens"], [])

            def event(kind: str, data: dict) -> str:
                return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

            async def events():
                yield event("message_start", {"message": {
                    "id": "msg-1", "type": "message", "role": "assistant", "model": body["model"], "content": [],
                    "usage": {"input_tokens": len(self._prompt_ids(body)), "output_tokens": 0}}})
                yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                count = 0
                async for text, _ in tokens:
                    if count == self.die_after_tokens:
                        self.errored = True
                        yield f"event: error\ndata: {json.dumps(VLLM_MESSAGES_ENGINE_DEAD_EVENT)}\n\n"
                        return
                    count += 1
                    yield event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})
                yield event("content_block_stop", {"index": 0})
                yield event("message_delta", {"delta": {"stop_reason": "max_tokens"},
                                              "usage": {"output_tokens": count}})
                yield event("message_stop", {})

            return StreamingResponse(events(), media_type="text/event-stream")

        @app.post("/tokenize")
        async def tokenize(raw: Request):
            tokens = self._prompt_ids(json.loads(await raw.body()))
            return {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}

        return app

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.running), num_finished=self.num_finished)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.running)

    def num_generated_tokens(self, request_ids) -> int:
        return sum(self.generated.get(request_id, 0) for request_id in request_ids)

    async def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
