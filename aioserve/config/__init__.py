"""aioserve's configuration: every argument declared once, and the typed configs built from it.

- `declaration.py`: what an argument is (`Argument`, vLLM's config groups, `PlatformDefault`)
  and how a given value is checked (`ConfigError`);
- `values.py`: the value converters the declarations use;
- `arguments.py`: every `vllm serve` argument, supported or not, with its real default
  (the HTTP server's in `frontend_arguments.py`);
- `parser.py`: argparse from the declarations (`--help`, `--config`, dotted JSON keys);
- `engine.py`: `EngineConfig` (ModelConfig, LoadConfig, CacheConfig, SchedulerConfig);
- `frontend.py`: `FrontendConfig`, the HTTP server's.

Nothing here imports torch, so `--help` and argument errors come before any model work.
"""
