"""Routing policies: each picks the replica for a newly arrived request (one file each, chosen
by Hydra `_target_` in scenarios/router/). A router reads replicas only through
sim.router.view; mechanism modules never import this package."""
