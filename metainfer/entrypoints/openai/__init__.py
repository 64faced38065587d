"""The OpenAI-compatible server, one job per module.

errors (OpenAI error bodies) <- protocol (request bodies, their checks, usage) <- metrics (Prometheus)
<- engine_loop (the one engine thread and the requests waiting on it) <- serving_base (what both
endpoints share) <- serving_completion / serving_chat <- api_server (the FastAPI app, auth, run).
Nothing is imported here, so `metainfer` imports without fastapi/uvicorn installed.
"""
