"""The throughput-quality frontier (`make frontier`): for each policy and compression ratio, output tok/s at
its own max batch under one KV memory limit against perplexity on held-out text, one point each, measured on
the same replicas, with the Pareto frontier marked (`workloads.frontier.report`)."""
