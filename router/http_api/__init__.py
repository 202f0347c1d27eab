"""The router's OpenAI-compatible HTTP API: schemas (request bodies), convert (-> duet.v1), render
(-> OpenAI JSON / SSE), errors (OpenAI error JSON), streaming (SSE and disconnects), app (FastAPI
routes over the router's pipeline), server (uvicorn on the router's event loop)."""
