"""Kubernetes manifests, the container file and their checks (docs/deploy.md)."""
