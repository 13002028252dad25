"""Serving topologies over the engine: disaggregated prefill and decode (`disagg`), with its
router policy (`router`, torch-free), control messages (`mailbox`) and K/V transfer (`transfer`).

The top of the dependency chain, above `integrations`: it may use every other sub-package, and none
imports it.
"""
