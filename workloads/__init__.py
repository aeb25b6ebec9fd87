"""Workloads: suites, the sweep runner, prompts from real text, results and reports."""
