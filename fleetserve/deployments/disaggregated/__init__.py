"""Disaggregated serving: prefill and decode pools, with KV moved between them by vLLM's NixlConnector."""
