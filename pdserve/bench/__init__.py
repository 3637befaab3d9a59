"""`pdserve bench`: load generation against a running gateway, and the numbers it reports.

    workloads  what to send: random, shared-prefix, sessions (multi-turn), file (ShareGPT JSON)
    arrivals   when to send it: Poisson / gamma (bursty) start times, or all at once
    client     sends it over gRPC and times every chunk (open loop, optionally capped concurrency)
    baseline   the same requests through transformers generate() in-process
    report     metrics (throughput, TTFT, TPOT, ITL, e2e percentiles, goodput), table, JSON
    plot       latency CDFs and throughput vs request rate (matplotlib, optional)
    progress   a progress bar on stderr

The command itself is `pdserve.commands.bench`.
"""
