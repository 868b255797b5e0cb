"""OpenAI's Batch API (/v1/files, /v1/batches): one batch service beside the ingress."""
