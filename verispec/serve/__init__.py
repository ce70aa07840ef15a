"""`verispec serve`: an OpenAI-compatible HTTP server over the batched engine (FastAPI on uvicorn)."""
