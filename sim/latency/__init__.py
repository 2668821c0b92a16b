"""Step-time model: a pure function of a batch shape and a GPU profile."""
from sim.latency.model import BatchShape, LatencyModel
from sim.latency.profile import GpuProfile, available_profiles, load_profile

__all__ = ["BatchShape", "LatencyModel", "GpuProfile", "available_profiles", "load_profile"]
