"""The parallel runtime: process groups, collectives, sharded layers and everything that runs in a step.

It executes a plan from `autotp.planning` on a model; each collective sits next to its backward.
It imports `autotp.compat` and `autotp.planning`, never the files tier or the entry points.
"""
