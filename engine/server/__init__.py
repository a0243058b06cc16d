"""The OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics, the RL routes and vLLM's /tokenize, /detokenize, /version, over one
`AsyncEngine`. The guarantees are in docs/server.md.

Owns HTTP concerns only, one module per role:
- `app`: `create_app` (auth, error handlers, health / metrics / models, the routes' wiring);
- `body`: the JSON body, its size / nesting / value limits, the model and known-field checks;
- `streaming`: the one path from admitted requests to a client (admission, disconnect racing
  and aborts, final responses, SSE from DELTA outputs, usage, latency metrics, errors);
- `chat_prompt`: a chat request's template fields and rendering (chat and /tokenize share it);
- `completions`, `chat`, `rl_routes`, `tokens`: each route's wire format.
Everything about sampling lives in the engine; the field lists and typed getters in
`openai_protocol`. `cuttle.engine` itself never imports this package (fastapi is the `serve`
extra).
"""
from cuttle.engine.server.app import create_app
from cuttle.engine.server.body import MAX_BODY_BYTES, MAX_JSON_DEPTH, json_body
from cuttle.engine.server.rl_routes import add_rl_routes
from cuttle.engine.server.streaming import admit, as_openai_error, until_disconnect

__all__ = ["create_app", "add_rl_routes", "MAX_BODY_BYTES", "MAX_JSON_DEPTH", "json_body", "admit", "as_openai_error",
           "until_disconnect"]
