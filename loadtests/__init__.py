"""The serving benchmark: `radixmesh bench serving`, or `python -m loadtests serving`.

workloads/ generates sessions from a seed; client.py speaks the backends (openai,
openai-chat, sglang); runner.py offers the load (Poisson arrivals, concurrency cap,
warm-up); metrics.py, report.py and plots.py turn request records into figures;
compare.py runs one workload against several endpoints.
"""
