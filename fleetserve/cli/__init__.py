"""Every ``fleetserve`` command (typer): serve, status, deploy, plan, bench, router, autoscale, auth.

``main.app`` is the entry point; each command imports its subsystem only when it runs.
"""
