"""The OpenAI-compatible HTTP layer, shared by the single server and the conductor.

    POST /v1/completions        prompt: text, token ids, or a batch of either
    POST /v1/chat/completions   messages rendered with the model's chat template
    GET  /v1/models, /v1/models/{id}, /health, /metrics (Prometheus)

Both POST endpoints take the usual fields (`max_tokens`, `temperature`,
`top_p`, `n`, `stop`, `seed`, `logprobs`, `user`, `stream`, `stream_options`)
plus vLLM's extensions `top_k`, `ignore_eos` and `stop_token_ids`, and stream
server-sent events ending in `data: [DONE]` when `stream` is true. `usage`
carries OpenAI's `prompt_tokens_details.cached_tokens`: the prompt tokens
served from a prefix cache (local, or the cluster's KV pool).

Completions also take `echo` (as OpenAI and vLLM): each choice's text starts
with the prompt, and with `logprobs=k` its logprobs cover the prompt tokens
first (the first one has none: null) and then the generated ones; a stream
sends the prompt in each choice's first chunk. `max_tokens=0` is accepted
with `echo` only: it scores the prompt and generates nothing, which is how
lm-evaluation-harness computes loglikelihoods.

The parts, one file each:

    protocol.py    reading and checking requests (413, 422, 400, 404), OpenAI's error bodies, usage
    streaming.py   engine outputs -> OpenAI JSON or server-sent events; client disconnects abort
    metrics.py     Prometheus: request latencies and counts, and the server's own gauges
    app.py         the routes over a frontend; the single server (`build_app`, `run_server`); uvicorn
"""

from nanoforge.serve.api.app import Server, build_app, openai_app, run_server
from nanoforge.serve.api.protocol import error_body

__all__ = ["Server", "build_app", "error_body", "openai_app", "run_server"]
