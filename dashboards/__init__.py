"""The Grafana dashboards, Grafana provisioning files and Prometheus alert rules that come
with diag, as package data (`diag dashboards` writes them out); `generate.py` rebuilds the
dashboards from the exporter's metric table."""
