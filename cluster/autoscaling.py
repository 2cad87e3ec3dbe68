"""Kept so that serve configs naming `cluster.autoscaling:SpeculationAwarePolicy` keep working; the
policy lives in cluster/serve/autoscaling.py."""
from cluster.serve.autoscaling import SpeculationAwarePolicy

__all__ = ["SpeculationAwarePolicy"]
