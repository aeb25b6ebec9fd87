"""Prometheus config, Grafana dashboards and provisioning, and helpers to run and check them (stdlib only)."""
