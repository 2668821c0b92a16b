"""Workloads: requests, sessions and the generators and readers that produce them."""
