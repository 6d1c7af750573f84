"""The `vllm serve` arguments of the HTTP server (vLLM's Frontend group), declared as
arguments.py declares the engine's: it puts them first in ARGUMENTS."""

from __future__ import annotations

from aioserve.config import values
from aioserve.config.declaration import FRONTEND, Argument, vllm_only

TOOL_STRICT_LEVELS = ("auto", "function", "parameter")
# vLLM's AnthropicDisabledThinkingEffortOption: "auto", "none" and Anthropic's efforts.
DISABLED_THINKING_EFFORTS = ("auto", "none", "low", "medium", "high", "xhigh", "max")

# fmt: off
FRONTEND_ARGUMENTS: tuple[Argument, ...] = (
    Argument("host", FRONTEND, None, "Address the HTTP server binds to. Default: all interfaces.",
             convert=values.string),
    Argument("port", FRONTEND, 8000, "TCP port of the HTTP server (0: any free port).",
             convert=values.port),
    Argument("uds", FRONTEND, None,
             "Serve HTTP (HTTPS with --ssl-certfile) on this Unix domain socket path instead "
             "of TCP; --host and --port are then ignored, as in vLLM. A socket file left there "
             "by a server that is gone is replaced; anything else at the path (a file, a live "
             "server) stops the start. The socket file is removed when the server stops.",
             convert=values.string, metavar="PATH"),
    Argument("uvicorn-log-level", FRONTEND, "info",
             "Log level of the HTTP layer (aiohttp and the access log); trace means debug.",
             convert=values.string, choices=("debug", "info", "warning", "error", "critical", "trace")),
    Argument("disable-uvicorn-access-log", FRONTEND, False,
             "Do not log one line per HTTP request.", "bool", convert=values.boolean),
    Argument("disable-access-log-for-endpoints", FRONTEND, None,
             "Request paths, separated by commas, whose access-log lines are not written, e.g. "
             "\"/health,/metrics\": a path matches exactly (no prefixes), whatever the query "
             "string, as vLLM's filter matches them.", convert=values.endpoint_paths,
             metavar="PATHS"),
    Argument("allow-credentials", FRONTEND, False,
             "CORS: allow cookies and authorization headers.", "bool", convert=values.boolean),
    Argument("allowed-origins", FRONTEND, [],
             "CORS: allowed origins (a JSON list); none by default, as vLLM: cross-origin "
             "browser access is off until origins are listed.", convert=values.json_names),
    Argument("allowed-methods", FRONTEND, ["*"], "CORS: allowed HTTP methods (a JSON list).",
             convert=values.json_names),
    Argument("allowed-headers", FRONTEND, ["*"], "CORS: allowed request headers (a JSON list).",
             convert=values.json_names),
    Argument("api-key", FRONTEND, None,
             "Require 'Authorization: Bearer <key>' with one of these keys on the /v1 routes "
             "(the environment variable VLLM_API_KEY does the same when this is not given).",
             "list", convert=values.names),
    Argument("lora-modules", FRONTEND, None,
             "LoRA adapters loaded at start (with --enable-lora), each served under its own "
             "model name: name=path, or JSON {\"name\": ..., \"path\": ..., "
             "\"base_model_name\": ...}.", "list", convert=values.lora_modules),
    vllm_only("prompt-adapters", FRONTEND, None, "Prompt adapters loaded at start, as name=path.", "list"),
    Argument("chat-template", FRONTEND, None,
             "Chat template file, or the template itself on one line. Default: the tokenizer's.",
             convert=values.string),
    Argument("chat-template-content-format", FRONTEND, "auto",
             "Give message content to the template as a string or as a list of OpenAI parts.",
             convert=values.string, choices=("auto", "string", "openai")),
    Argument("default-chat-template-kwargs", FRONTEND, None,
             "Variables for the chat template (JSON object), under each request's "
             "chat_template_kwargs, e.g. {\"enable_thinking\": false}.", "json",
             convert=values.json_object),
    Argument("trust-request-chat-template", FRONTEND, False,
             "Render a request's own chat_template (or chat_template_kwargs.chat_template), "
             "Jinja from the client, instead of the server's; only for trusted clients. "
             "Without it such a request is a 400.", "bool", convert=values.boolean),
    Argument("response-role", FRONTEND, "assistant",
             "Role of the reply when the request sets add_generation_prompt.", convert=values.string),
    Argument("ssl-keyfile", FRONTEND, None, "TLS private key file (PEM).", convert=values.string),
    Argument("ssl-certfile", FRONTEND, None,
             "TLS certificate file (PEM); serves HTTPS when given.", convert=values.string),
    Argument("ssl-ca-certs", FRONTEND, None,
             "CA certificates for checking client certificates.", convert=values.string),
    Argument("ssl-cert-reqs", FRONTEND, 0,
             "Whether clients must present a certificate: 0 (CERT_NONE), 1 (CERT_OPTIONAL) or "
             "2 (CERT_REQUIRED), as Python's ssl constants.", convert=values.cert_reqs),
    Argument("ssl-ciphers", FRONTEND, None,
             "TLS cipher suites the server accepts (an OpenSSL cipher list, for TLS 1.2 and "
             "below; TLS 1.3 keeps its own suites), e.g. "
             "'ECDHE-RSA-AES256-GCM-SHA384:ECDHE-RSA-CHACHA20-POLY1305'. Default: OpenSSL's.",
             convert=values.cipher_list),
    Argument("enable-ssl-refresh", FRONTEND, False,
             "Load the TLS certificate chain and CA certificates again when their files "
             "change (checked every second): new connections get them, no restart.", "bool",
             convert=values.boolean),
    Argument("root-path", FRONTEND, None,
             "URL prefix when served behind a path-routing proxy: every route answers with "
             "and without it, and the OpenAPI schema names it.", convert=values.root_path),
    Argument("middleware", FRONTEND, [],
             "Extra HTTP middleware, as the import path of an aiohttp middleware "
             "(async (request, handler) -> response); repeatable.", "append",
             convert=values.import_paths),
    Argument("return-tokens-as-token-ids", FRONTEND, False,
             "Write logprob tokens as 'token_id:{id}' so that any token can be identified.", "bool",
             convert=values.boolean),
    Argument("disable-frontend-multiprocessing", FRONTEND, False,
             "Run the API server in the engine's process; aioserve always does.", "flag",
             convert=values.boolean),
    Argument("enable-request-id-headers", FRONTEND, False,
             "Add an X-Request-Id header to every response: the client's, or a new one.", "bool",
             convert=values.boolean),
    Argument("enable-auto-tool-choice", FRONTEND, False,
             "Allow tool_choice 'auto': the output is read into tool calls by --tool-call-parser.",
             "bool", convert=values.boolean),
    Argument("tool-call-parser", FRONTEND, None,
             "How outputs become tool calls with tool_choice 'auto': deepseek_v3, granite, "
             "hermes, internlm, llama3_json, mistral, phi4_mini_json, pythonic, qwen3_coder or "
             "xlam (vLLM's formats), or one a --tool-parser-plugin registers.",
             convert=values.string),
    Argument("tool-strict-level", FRONTEND, "auto",
             "With tool_choice 'auto', hold calls to the request's tools by a structural tag: "
             "auto (only when a tool says strict), function (always; arguments checked for "
             "strict tools) or parameter (every tool's arguments checked; also for "
             "'required' and named calls, which such a parser's tag always holds). Needs a "
             "--tool-call-parser with a structural form (hermes, llama3_json, qwen3_coder, "
             "deepseek_v3) unless auto.", convert=values.string, choices=TOOL_STRICT_LEVELS,
             choice_noun="tool strict level"),
    Argument("anthropic-disabled-thinking-effort", FRONTEND, "auto",
             "The reasoning_effort /v1/messages gives the chat template for thinking "
             "'disabled': auto (none, unless the template refuses it or renders it as a "
             "thinking effort: then low, found once by rendering) or that effort.",
             convert=values.string, choices=DISABLED_THINKING_EFFORTS,
             choice_noun="disabled thinking effort"),
    Argument("tool-parser-plugin", FRONTEND, "",
             "A Python file that registers more tool-call parsers "
             "(aioserve.server.tool_calls.register_tool_parser).", convert=values.string),
    Argument("exclude-tools-when-tool-choice-none", FRONTEND, False,
             "Leave a request's tools out of the chat template when its tool_choice is 'none'.",
             "bool", convert=values.boolean),
    Argument("enable-prompt-tokens-details", FRONTEND, False,
             "Report prompt_tokens_details in the usage block.", "bool", convert=values.boolean),
    Argument("enable-server-load-tracking", FRONTEND, False,
             "Count the requests in flight and report them at GET /load.", "bool",
             convert=values.boolean),
    Argument("sse-keep-alive-interval", FRONTEND, 0,
             "While a streamed /v1/completions or /v1/chat/completions response (or one of "
             "theirs through /invocations) has sent nothing for this many seconds (queued, in "
             "prefill, between tokens), send the SSE comment ': keep-alive', so that proxies "
             "with read timeouts keep the connection; 0: never.",
             convert=values.keep_alive_interval, metavar="SECONDS"),
    Argument("disable-fastapi-docs", FRONTEND, False,
             "Hide the OpenAPI schema (/openapi.json) and the documentation page (/docs).", "bool",
             convert=values.boolean),
    Argument("enable-offline-docs", FRONTEND, False,
             "Serve /docs with nothing fetched from the internet, for air-gapped hosts. "
             "aioserve's page is always self-contained (no CDN), so it is the same page "
             "either way; --disable-fastapi-docs wins, as in vLLM.", "bool",
             convert=values.boolean),
    # vLLM hands these two to uvicorn's h11 parser (in vLLM 0.32 uvicorn reads only the
    # first, and only when it runs h11 rather than httptools); here they are aiohttp's limits.
    Argument("h11-max-incomplete-event-size", FRONTEND, 4194304,
             "Most bytes of a request head (request line and headers) taken before it ends, "
             "h11's limit against oversized headers: aiohttp's max_line_size and max_field_size "
             "(one line), and the whole head here; past it the request is answered 400 and its "
             "connection closed, as uvicorn answers.", convert=values.integer_at_least(1),
             metavar="BYTES"),
    Argument("h11-max-header-count", FRONTEND, 256,
             "Most headers a request may have: aiohttp's max_headers; a request with more is "
             "answered 400 and its connection closed.", convert=values.integer_at_least(1),
             metavar="N"),
    Argument("max-log-len", FRONTEND, None,
             "Cut logged requests to this many characters. Default: no limit.",
             convert=values.integer_at_least(0)),
    Argument("disable-log-stats", FRONTEND, False,
             "Do not log engine statistics periodically.", "flag", keyword=True, convert=values.boolean),
    Argument("disable-log-requests", FRONTEND, False,
             "Deprecated in vLLM: do not log requests (they are logged only with "
             "--enable-log-requests).",
             "bool", convert=values.boolean),
    Argument("enable-log-requests", FRONTEND, False, "Log each request.", "bool", convert=values.boolean),
    Argument("enable-log-outputs", FRONTEND, False,
             "Log each chat and Responses answer as vLLM logs generated outputs (its text "
             "and finish reason at INFO, its token ids at DEBUG): streamed answers delta by "
             "delta and then whole. Needs --enable-log-requests.", "bool", convert=values.boolean),
    Argument("enable-log-deltas", FRONTEND, True,
             "With --enable-log-outputs, log each streamed delta too (--no-enable-log-deltas: "
             "only the whole answer).", "bool", convert=values.boolean),
    Argument("log-error-stack", FRONTEND, None,
             "Log the stack trace of every error response. Default: on when "
             "VLLM_SERVER_DEV_MODE=1, as in vLLM.", "bool", convert=values.boolean),
    Argument("enable-force-include-usage", FRONTEND, False,
             "Usage on every request: streamed completions and chat completions report it in "
             "every chunk and in a last chunk, as with stream_options {\"include_usage\": true, "
             "\"continuous_usage_stats\": true}.", "bool", convert=values.boolean),
    Argument("enable-per-request-metrics", FRONTEND, False,
             "Add the request's timings to each answer's \"metrics\" (time_to_first_token_ms, "
             "generation_time_ms, queue_time_ms, mean_itl_ms, tokens_per_second): completions "
             "and chat completions of one sequence (in a stream, on its usage chunk), and "
             "responses. Not with --disable-log-stats.", "bool", convert=values.boolean),
    Argument("enable-tokenizer-info-endpoint", FRONTEND, False,
             "Serve GET /tokenizer_info: the tokenizer's configuration, its class and the chat "
             "template of --chat-template (this may expose templates).", "bool",
             convert=values.boolean),
    Argument("fingerprint-mode", FRONTEND, "full",
             "The responses' system_fingerprint: full, aioserve-<version>-<hash of the engine's "
             "settings> (aioserve runs no parallelism for vLLM's tp/pp/dp/ep parts); hash, the "
             "same; custom, --fingerprint-value; none, null.", convert=values.string,
             choices=("full", "hash", "custom", "none")),
    Argument("fingerprint-value", FRONTEND, None,
             "The system_fingerprint with --fingerprint-mode custom.", convert=values.string),
    Argument("enable-scale-out", FRONTEND, False,
             "Serve vLLM's scale-out routes (server/scale_out.py): POST /v1/completions/render "
             "and /v1/chat/completions/render (a request as token ids and sampling params), "
             "/inference/v1/generate (tokens in, tokens out) and /inference/v1/abort_requests; "
             "/v1/messages/render, /v1/responses/render and the /derender routes answer 501 "
             "(not served yet). Without it (and without --tokens-only) they answer 403, as "
             "vLLM's.", "bool", convert=values.boolean),
    Argument("tokens-only", FRONTEND, False,
             "vLLM's Tokens In<>Out mode: the tokenizer is not loaded (as with "
             "--skip-tokenizer-init), the scale-out routes are served (as with "
             "--enable-scale-out, and POST /abort_requests too), and /inference/v1/generate "
             "answers token ids only, refusing stop strings and output_mode text.", "bool", convert=values.tokens_only),
    # vLLM's ObservabilityConfig; a Frontend argument here, since the HTTP server makes the
    # spans (server/tracing.py).
    Argument("otlp-traces-endpoint", FRONTEND, None,
             "Send one OpenTelemetry span per finished request to this OTLP endpoint "
             "(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: grpc, the default, or http/protobuf), "
             "its parent the request's traceparent header. Needs the opentelemetry-sdk, "
             "-api and -exporter-otlp packages.", convert=values.string),
    Argument("custom-histogram-buckets", FRONTEND, None,
             "Bucket bounds (JSON object) replacing the defaults of /metrics' histograms by "
             "family: request_latency, time_to_first_token, inter_token_latency, "
             "iteration_tokens, request_params_n, request_num_preemptions, request_tokens; "
             "each a list of strictly increasing, positive, finite bounds, e.g. "
             "{\"request_latency\": [0.01, 0.05, 0.1, 0.5]}.",
             "json", convert=values.histogram_buckets),
    Argument("shutdown-timeout", FRONTEND, 30.0,
             "On SIGTERM or SIGINT, answer new requests with 503 and let the requests in flight "
             "finish for up to this many seconds before exiting; 0 aborts them at once "
             "(vLLM's default). A second signal stops at once.", convert=values.seconds),
    vllm_only("headless", FRONTEND, False,
          "Run the engine without an API server (secondary data-parallel node).", "flag"),
    vllm_only("use-v2-block-manager", FRONTEND, True, "Deprecated in vLLM; has no effect.", "flag"),
)
# fmt: on
