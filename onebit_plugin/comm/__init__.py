"""Collectives and communicators: process groups and waits (``collectives``), the exact and 1-bit
allreduces (``allreduce``), the topology that gives every collective its group, and the byte
counts.
"""
