"""`aioserve bench`: vLLM's benchmark tools (`throughput`, `latency`, `serve`) for aioserve.

cli.py holds the command line; throughput.py, latency.py and serve.py the benchmarks;
datasets.py and workload.py the requests they send; endpoints.py the HTTP client of
`serve` and statistics.py its metrics; hf_backend.py transformers as the offline peer.
"""
