"""`kvports serve`: an OpenAI-compatible HTTP server over the continuous-batching engine (docs/SERVING.md).

One module per job:
- `schemas`: request bodies checked field by field, and the OpenAI error object every refusal is
- `detokenize`: the new tokens as text, decoded as they come, cut at a stop string
- `loop`: the engine's loop, in its own thread: requests join the running batch, tokens go back as made
- `metrics`: the Prometheus metrics `/metrics` shows
- `app`: the FastAPI application: the endpoints, streaming, the API key
- `connections`: uvicorn's server for it: deadlines on each request's headers and body, and a
  shutdown that ends every running request with its last chunk

FastAPI, uvicorn and prometheus-client are the `serve` extra: nothing here is imported by the
rest of kvports, and `kvports serve` without them says what to install.
"""
