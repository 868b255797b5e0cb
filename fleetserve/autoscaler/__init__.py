"""Autoscaling: policies (pure), a trace-driven simulator, and the Ray Serve adapter (serve_adapter.py)."""
