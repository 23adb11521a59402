"""The lab: engines, router, kvproxy and a workload in virtual time (no HTTP, no sleeping)."""
