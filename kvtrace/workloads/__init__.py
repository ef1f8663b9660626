"""Workloads: everything that writes a workload trace (synthetic presets, imported request logs).

A workload trace holds the *input* records of requests (arrivals, prompt hash ids, decode
lengths) and, in its header, the engine configuration it is meant to be replayed under.
"""
