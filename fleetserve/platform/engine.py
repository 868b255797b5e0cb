"""A plain async wrapper around vLLM's AsyncLLM: generate, abort, stats.

This is the only place that speaks vLLM's Python API. Everything above it exchanges the small
dataclasses below, so the serving layer can be tested with a fake engine and the engine can be
tested without Ray.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetserve.platform.config import ConfigError, ModelConfig
from fleetserve.platform.kv_transfer import KVTransferSpec
from fleetserve.platform.nixl_tuning import DELAY_ENV as NIXL_DELAY_ENV
from fleetserve.platform.progress import note_request
from fleetserve.platform.stats import EngineStats, StatsListener, StatsRecorder

logger = logging.getLogger(__name__)


class EngineRequestError(ValueError):
    """A request the engine refuses; carries the HTTP status and OpenAI error fields."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None,
                 error_type: str = "invalid_request_error", code: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.error_type = error_type
        # OpenAI's error ``code`` (e.g. ``prefill_unavailable``); None: none.
        self.code = code
        # The Retry-After the response carries, for a refusal worth retrying; None: none.
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # survives pickling across Ray with its fields
        return (EngineRequestError, (self.message, self.status_code, self.param, self.error_type, self.code,
                                     self.retry_after_s))


class EngineDeadError(RuntimeError):
    """A replica's engine core has died: it can serve nothing until Serve's health check replaces the replica.
    Raised before a response starts, so the caller may send the request to another replica."""

    def __init__(self, replica_id: str) -> None:
        super().__init__(f"replica {replica_id}'s engine has died; Serve is replacing the replica")
        self.replica_id = replica_id

    def __reduce__(self):  # survives pickling across Ray with its replica
        return (EngineDeadError, (self.replica_id,))


def dead_replica_id(error: BaseException) -> str | None:
    """The replica whose dead engine failed a request (the error possibly wrapped by Ray); None for others."""
    cause = getattr(error, "cause", None) or error
    return cause.replica_id if isinstance(cause, EngineDeadError) else None


@dataclass(frozen=True)
class SamplingOptions:
    """What the API layer asks of one generation; translated to vLLM SamplingParams."""

    # Most tokens to generate; None fills the context window.
    max_tokens: int | None = 16
    # Fewest tokens before a stop condition may end the output.
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    # -1 or 0 disables top-k.
    top_k: int = 0
    seed: int | None = None
    # Strings that end the output; the stop string itself is not returned.
    stop: tuple[str, ...] = ()
    # Token ids that end the output.
    stop_token_ids: tuple[int, ...] = ()
    # Keep generating past EOS (benchmarks use it for exact output lengths).
    ignore_eos: bool = False
    # Top-n logprobs per generated token; None returns none.
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token with its logprob and the top alternatives."""

    token_id: int
    token: str
    logprob: float
    # (token, logprob) pairs, most likely first.
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class GenerationDelta:
    """What one engine step added to a request's output."""

    # New text since the previous delta (after stop-string handling).
    text: str
    # New token ids since the previous delta; may hold several when steps coalesce.
    token_ids: list[int]
    # Set on the last delta: "stop", "length" or "abort".
    finish_reason: str | None = None
    # Which stop string or token ended it, when finish_reason is "stop" for that cause.
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    # On the last delta of a request run with KV transfer: what the peer engine needs to continue it
    # (a prefill's remote block ids and handshake address, for the decode engine).
    kv_transfer_params: dict[str, Any] | None = None


def chat_token_ids(tokenizer: Any, messages: Sequence[dict[str, Any]], chat_template: str | None = None) -> list[int]:
    """A chat's prompt token ids, exactly as the engine builds them (the router hashes the same ids).

    Args:
        chat_template: the template the model's replicas render with; None: the tokenizer's own.

    Raises:
        ValueError: the tokenizer has no chat template, or the template rejects the messages.
    """
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False,
                                         chat_template=chat_template)
    # The template writes its own special tokens; adding them again would double the BOS.
    return list(tokenizer.encode(text, add_special_tokens=False))


# The topic engines publish their KV cache events under (fleetserve.router.replica.kv_events subscribes to it).
KV_EVENTS_TOPIC = "kv"


class Engine:
    """One vLLM engine (AsyncLLM) serving one model."""

    def __init__(self, llm: Any, model_name: str, recorder: StatsRecorder, frontend_args: Any) -> None:
        self._llm = llm
        self.model_name = model_name
        self._recorder = recorder
        self.tokenizer = llm.get_tokenizer()
        # vLLM's parsed server flags for this model's OpenAI app.
        self._frontend_args = frontend_args
        # Prompt tokens of requests with no output yet: the prefill backlog autoscaling reads.
        self.num_pending_prompt_tokens = 0
        self._app: Any = None
        self._app_lock = asyncio.Lock()

    async def openai_app(self) -> Any:
        """vLLM's own OpenAI app over this engine, built once (it needs a running event loop)."""
        async with self._app_lock:
            if self._app is None:
                from fleetserve.platform.openai_app import build_openai_app

                self._app = await build_openai_app(_ObservedClient(self._llm, self), self._frontend_args)
        return self._app

    @classmethod
    def create(cls, model: ModelConfig, model_path: Path, cpu_binding: str | None = None,
               stats_listeners: Sequence[StatsListener] = (),
               kv_transfer: KVTransferSpec | None = None, kv_events_port: int | None = None) -> Engine:
        """Builds the AsyncLLM for ``model`` from a resolved HF folder.

        Args:
            model: the model's platform config.
            model_path: local HF folder, from the model store.
            cpu_binding: cores for the vLLM CPU worker (VLLM_CPU_OMP_THREADS_BIND); ignored on GPU.
            stats_listeners: also fed every engine step's stats (e.g. ``EngineMetrics``).
            kv_transfer: joins KV transfer with prefill/decode peers; None serves colocated.
            kv_events_port: publishes the engine's KV cache events (topic KV_EVENTS_TOPIC) on this port
                of every interface, for the router; None publishes none.

        Raises:
            ConfigError: an ``engine_args.extra`` key that vLLM does not know, or an ``api`` flag vLLM rejects
                (both before any weights load).
        """
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        from fleetserve.platform.openai_app import frontend_args, vllm_engine_arg_names

        frontend = frontend_args(model, model_path)

        on_cpu = _on_cpu()
        kwargs = shared_gpu_defaults(model, scale_to_zero_defaults(model, model.engine_kwargs(), on_cpu), on_cpu)
        if model.api.reasoning_parser is not None:
            # An engine arg in vLLM: structured outputs must know where reasoning ends.
            kwargs.setdefault("reasoning_parser", model.api.reasoning_parser)
        unknown = sorted(set(model.engine_args.extra) - vllm_engine_arg_names())
        if unknown:
            raise ConfigError(f"models[{model.name}].engine_args.extra: vLLM has no engine args {unknown}")
        if cpu_binding is not None:
            # Read by the worker process at spawn; must be set before the engine is built.
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = split_binding(cpu_binding,
                                                                    model.engine_args.tensor_parallel_size)
        if model.engine_args.tensor_parallel_size > 1:
            # Every rank on this replica's node, on the GPUs Ray gave it: vLLM would otherwise pick its Ray
            # executor inside a Ray actor and ask the cluster for GPUs outside the replica's own.
            kwargs["distributed_executor_backend"] = "mp"
        if kv_transfer is not None:
            # Also read at spawn, by the connector inside the engine core and worker processes.
            os.environ.update(kv_transfer.env())
            kwargs["kv_transfer_config"] = kv_transfer.vllm_config()
        else:
            os.environ.pop(NIXL_DELAY_ENV, None)
        if kv_events_port is not None:
            kwargs["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                          "endpoint": f"tcp://*:{kv_events_port}", "topic": KV_EVENTS_TOPIC}
        args = AsyncEngineArgs(model=str(model_path), served_model_name=[model.name],
                               disable_log_stats=False, **kwargs)
        recorder = StatsRecorder(stats_listeners)
        # As `vllm serve` builds it: vLLM sizes max_num_seqs and max_num_batched_tokens by the hardware for an API
        # server only (1024 and 8192 on an H100, 2 x 128 and 2 x 2048 on two CPU ranks); another context gets 128
        # and 2048 anywhere.
        llm = AsyncLLM.from_engine_args(args, usage_context=UsageContext.OPENAI_API_SERVER,
                                        stat_loggers=[recorder.stat_logger_factory()])
        return cls(llm, model.name, recorder, frontend)

    @property
    def kv_capacity_tokens(self) -> int | None:
        """Tokens the KV cache holds (blocks x block size); None before vLLM has sized it."""
        cache = self._llm.vllm_config.cache_config
        return cache.num_gpu_blocks * cache.block_size if cache.num_gpu_blocks else None

    @property
    def max_num_seqs(self) -> int:
        """Requests the engine runs at once: the config's, else what vLLM chose for the hardware."""
        return int(self._llm.vllm_config.scheduler_config.max_num_seqs)

    @property
    def block_size(self) -> int:
        """Tokens per KV block (the prefix cache's unit)."""
        return int(self._llm.vllm_config.cache_config.block_size)

    @property
    def max_model_len(self) -> int:
        return int(self._llm.model_config.max_model_len)

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Applies the model's chat template and tokenizes the result.

        Raises:
            EngineRequestError: the model has no chat template, or the template rejects the messages.
        """
        try:
            return chat_token_ids(self.tokenizer, messages)
        except ValueError as error:
            raise EngineRequestError(f"cannot apply the chat template of {self.model_name}: {error}",
                                     param="messages") from None

    def _sampling_params(self, options: SamplingOptions, kv_transfer_params: dict[str, Any] | None = None) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        try:
            return SamplingParams(
                max_tokens=options.max_tokens,
                min_tokens=options.min_tokens,
                temperature=options.temperature,
                top_p=options.top_p,
                top_k=options.top_k if options.top_k > 0 else -1,
                seed=options.seed,
                stop=list(options.stop),
                stop_token_ids=list(options.stop_token_ids),
                ignore_eos=options.ignore_eos,
                logprobs=options.logprobs,
                presence_penalty=options.presence_penalty,
                frequency_penalty=options.frequency_penalty,
                repetition_penalty=options.repetition_penalty,
                output_kind=RequestOutputKind.DELTA,
                extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None,
            )
        except ValueError as error:  # vLLM's own range checks (VLLMValidationError is a ValueError)
            raise EngineRequestError(str(error), param=getattr(error, "parameter", None)) from None

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """Returns the effective max_tokens, or raises if prompt plus output exceed max_model_len.

        Raises:
            EngineRequestError: 400 with the numbers in the message.
        """
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise EngineRequestError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{num_prompt_tokens} tokens, which leaves no room for output.", param="messages")
        if max_tokens is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + max_tokens > limit:
            raise EngineRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
                f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens")
        return max_tokens

    async def generate(self, prompt_token_ids: list[int], options: SamplingOptions, request_id: str,
                       kv_transfer_params: dict[str, Any] | None = None) -> AsyncIterator[GenerationDelta]:
        """Streams the output of one request as deltas.

        Closing the iterator early (client gone) aborts the request in the engine.

        Args:
            prompt_token_ids: the prompt.
            options: sampling options.
            request_id: unique among this engine's requests.
            kv_transfer_params: for an engine built with KV transfer: ``{"do_remote_decode": True}`` keeps a
                prefill's KV for a decode engine, and a prefill's returned params make this engine pull it.

        Raises:
            EngineRequestError: invalid sampling options or a prompt too long for the model.
        """
        max_tokens = self.check_length(len(prompt_token_ids), options.max_tokens)
        params = self._sampling_params(dataclasses.replace(options, max_tokens=max_tokens), kv_transfer_params)
        finished = False
        try:
            async for output in self._llm.generate({"prompt_token_ids": prompt_token_ids}, params, request_id):
                completion = output.outputs[0]
                finished = output.finished
                yield GenerationDelta(
                    text=completion.text,
                    token_ids=list(completion.token_ids),
                    finish_reason=completion.finish_reason if output.finished else None,
                    stop_reason=completion.stop_reason if output.finished else None,
                    num_prompt_tokens=len(prompt_token_ids),
                    num_cached_tokens=output.num_cached_tokens or 0,
                    logprobs=(self._convert_logprobs(completion, options.logprobs)
                              if options.logprobs is not None else None),
                    kv_transfer_params=output.kv_transfer_params if output.finished else None,
                )
        finally:
            if not finished:
                await self.abort(request_id)

    def _convert_logprobs(self, completion: Any, num_top: int) -> list[TokenLogprob] | None:
        if completion.logprobs is None:
            return None
        converted = []
        for token_id, candidates in zip(completion.token_ids, completion.logprobs, strict=False):
            # vLLM returns the top-n plus the sampled token when it ranks lower; OpenAI wants the top-n.
            ranked = sorted(candidates.items(), key=lambda item: item[1].rank)[:num_top]
            top = tuple((self._token_text(tid, lp), float(lp.logprob)) for tid, lp in ranked)
            chosen = candidates[token_id]
            converted.append(TokenLogprob(token_id=token_id, token=self._token_text(token_id, chosen),
                                          logprob=float(chosen.logprob), top=top))
        return converted

    def _token_text(self, token_id: int, logprob: Any) -> str:
        if logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])

    async def resident_lora_ids(self) -> set[int]:
        """vLLM's ids of the LoRA adapters the engine holds now (its adapter cache)."""
        return await self._llm.list_loras()

    async def abort(self, request_id: str) -> None:
        """Frees the request's KV blocks and stops its generation; unknown ids are ignored."""
        await self._llm.abort(request_id)

    def stats(self) -> EngineStats:
        """The scheduler's last reported state of this engine."""
        return self._recorder.snapshot()

    @property
    def errored(self) -> bool:
        """Whether the engine core has died (its process exited or its output loop failed)."""
        return bool(self._llm.errored)

    @property
    def num_unfinished_requests(self) -> int:
        """Requests the engine has taken and not finished."""
        return int(self._llm.get_num_unfinished_requests())

    def num_generated_tokens(self, request_ids: Sequence[str]) -> int:
        """Tokens generated so far for the unfinished ones of ``request_ids`` (vLLM's request ids).

        Read from vLLM's output processor, which counts each request's tokens every step even where its
        caller gets only the final output (a non-streamed request); 0 where vLLM keeps no such count.
        """
        total = 0
        try:
            processor = self._llm.output_processor
            for request_id in request_ids:
                for internal_id in processor.external_req_ids.get(request_id, ()):
                    state = processor.request_states.get(internal_id)
                    if state is not None and state.stats is not None:
                        total += state.stats.num_generation_tokens
        except AttributeError:  # another vLLM's output processor: no heartbeats rather than failed requests
            return 0
        return total

    async def check_health(self) -> None:
        """Raises if the engine core has died."""
        await self._llm.check_health()

    def shutdown(self) -> None:
        """Stops the engine core and worker processes (frees their shared memory)."""
        self._llm.shutdown()


class _ObservedClient:
    """The AsyncLLM as vLLM's app sees it, counting each prompt as prefill backlog until its first output."""

    def __init__(self, llm: Any, engine: Engine) -> None:
        self._llm = llm
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any):
        pending = len(prompt.get("prompt_token_ids") or ()) if isinstance(prompt, dict) else 0
        transfer = (getattr(sampling_params, "extra_args", None) or {}).get("kv_transfer_params") or {}
        if transfer.get("do_remote_prefill"):
            pending = 0  # the prompt's KV comes from a prefill replica; nothing is computed here
        self._engine.num_pending_prompt_tokens += pending
        note_request(request_id)
        try:
            async for output in self._llm.generate(prompt, sampling_params, request_id, **kwargs):
                self._engine.num_pending_prompt_tokens -= pending
                pending = 0
                yield output
        finally:
            self._engine.num_pending_prompt_tokens -= pending


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def scale_to_zero_defaults(model: ModelConfig, kwargs: dict[str, Any], on_cpu: bool) -> dict[str, Any]:
    """The engine args with what a pool that scales to zero gets unless it sets it: on CPU, eager mode.

    torch.compile added ~88 s to SmolLM2's 49 s cold start on CPU (docs/benchmarks.md, "Cold start from
    zero"), and every wake from zero pays it. ``engine_args.extra.enforce_eager: false`` keeps compiling.
    """
    if (not on_cpu or model.autoscaling is None or model.autoscaling.min_replicas > 0
            or "enforce_eager" in kwargs):
        return kwargs
    logger.info("%s scales to zero on CPU: eager mode (set engine_args.extra.enforce_eager to choose)", model.name)
    return {**kwargs, "enforce_eager": True}


def shared_gpu_defaults(model: ModelConfig, kwargs: dict[str, Any], on_cpu: bool) -> dict[str, Any]:
    """The engine args with the memory share a replica on part of a GPU gets unless it sets one.

    Ray packs replicas that ask for part of a GPU (``resources.num_gpus: 0.25``) onto one GPU, and vLLM's
    ``gpu_memory_utilization`` is each engine's share of the whole device, checked at start against the memory
    still free: at vLLM's default (0.92) the second engine on the GPU would not start. Each gets its part of
    that default instead (0.23 at a quarter GPU).
    """
    share = model.resources.num_gpus
    if on_cpu or not 0 < share < 1 or "gpu_memory_utilization" in kwargs:
        return kwargs
    from vllm.engine.arg_utils import AsyncEngineArgs

    utilization = round(share * AsyncEngineArgs.gpu_memory_utilization, 4)
    logger.info("%s takes %g of a GPU: gpu_memory_utilization %g", model.name, share, utilization)
    return {**kwargs, "gpu_memory_utilization": utilization}


def split_binding(binding: str, num_ranks: int) -> str:
    """One engine's cores (``"0-3"``, ``"0,2"``) split into contiguous sets, one per tensor-parallel rank, in
    vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` form (``"0-1|2-3"``); ranks share cores when there are fewer cores.
    A binding already split into ranks is kept."""
    if num_ranks == 1 or "|" in binding:
        return binding
    cores = [core for part in binding.split(",") for core in _core_range(part)]
    if len(cores) < num_ranks:
        return "|".join(str(cores[rank % len(cores)]) for rank in range(num_ranks))
    per_rank, extra = divmod(len(cores), num_ranks)
    groups, start = [], 0
    for rank in range(num_ranks):
        end = start + per_rank + (1 if rank < extra else 0)
        groups.append(_cores_text(cores[start:end]))
        start = end
    return "|".join(groups)


def _cores_text(cores: list[int]) -> str:
    """``[2, 3, 4]`` as ``"2-4"``, ``[5]`` as ``"5"``, ``[0, 2]`` as ``"0,2"``."""
    if len(cores) == 1:
        return str(cores[0])
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def _core_range(part: str) -> list[int]:
    first, _, last = part.strip().partition("-")
    return list(range(int(first), int(last or first) + 1))


def plan_cpu_binding(num_engines: int, num_cores: int) -> list[str]:
    """Splits cores into contiguous ranges, one per engine; engines share cores when too few.

    Two engines pinned to the same core halve each other's speed, so spreading matters on small hosts.
    """
    if num_engines <= 0:
        return []
    if num_engines >= num_cores:
        return [str(index % num_cores) for index in range(num_engines)]
    per_engine = num_cores // num_engines
    bindings = []
    for index in range(num_engines):
        first = index * per_engine
        last = num_cores - 1 if index == num_engines - 1 else first + per_engine - 1
        bindings.append(str(first) if first == last else f"{first}-{last}")
    return bindings
