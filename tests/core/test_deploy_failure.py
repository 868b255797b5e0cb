"""What a failed deployment's error says: the replica's own exception, not Serve's "Failed to update"."""

from fleetserve.deployments.local_run import MAX_CAUSE_LINES, failure_cause

SERVE_MESSAGE = """The deployment failed to start 3 times in a row. This may be due to a problem with its constructor or
initial health check failing. See controller logs for details. Error:
ray::ServeReplica:fleetserve:engine-m.initialize_and_get_metadata() (pid=1, ip=192.0.2.2)
RuntimeError: Traceback (most recent call last):
  File "/x/replica.py", line 1867, in initialize
    await self._user_callable_wrapper.initialize_callable()
  File "/x/engine.py", line 12, in create
    raise ConfigError("models[m].engine_args.extra: vLLM has no engine args ['enforce_eagre']")
fleetserve.platform.config.base.ConfigError: models[m].engine_args.extra: vLLM has no engine args ['enforce_eagre']
"""


def test_the_cause_is_the_last_exception_and_its_message():
    assert failure_cause(SERVE_MESSAGE) == ("fleetserve.platform.config.base.ConfigError: models[m].engine_args.extra: "
                                            "vLLM has no engine args ['enforce_eagre']")


def test_a_long_message_is_cut_and_one_without_an_exception_keeps_its_end():
    message = "ValueError: bad\n" + "\n".join(f"detail {index}" for index in range(20))
    kept = ["ValueError: bad"] + [f"detail {index}" for index in range(MAX_CAUSE_LINES - 1)]
    assert failure_cause(message).splitlines() == kept
    assert failure_cause("the replica was\nkilled\n\n") == "the replica was\nkilled"
