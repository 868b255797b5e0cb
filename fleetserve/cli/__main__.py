"""``python -m fleetserve.cli``: the same commands as the ``fleetserve`` script."""

from fleetserve.cli.main import app

app()
