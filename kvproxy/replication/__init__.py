"""Program admission's ledger replicated between kvproxy replicas (``state.backend:
redis``): the records and the ledger that folds them in (:mod:`~kvproxy.replication.ledger`,
pure) and the asyncio shell that sends and receives them on Redis
(:mod:`~kvproxy.replication.sync`). Apart from :mod:`kvproxy.state`, which the session
lifecycle uses, because it builds on :mod:`kvproxy.admission`."""
