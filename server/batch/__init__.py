"""OpenAI's Batch API (/v1/files, /v1/batches): files on disk, state in SQLite, lines fed
to the engine at a background priority through the live routes (docs/api.md)."""
