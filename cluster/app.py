"""Kept so that serve configs naming `import_path: cluster.app:build_app` keep working; the
application lives in cluster/serve/app.py."""
from cluster.serve.app import build_app

__all__ = ["build_app"]
