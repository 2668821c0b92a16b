"""SimPy processes: arrivals, replica step loops, the cluster and its router.

This is the only package where simulated time passes: one SimPy event per replica step, one per
session arrival and one per think-time delay, never one per token.
"""
