"""Program-aware admission: hold requests at kvproxy's boundary until the fleet's KV
pool can hold them (see docs/admission.md).

* :mod:`kvproxy.admission.ledger` - capacity, pressure, leases, TTL, epoch (pure);
* :mod:`kvproxy.admission.reservation` - reservation sizing (pure);
* :mod:`kvproxy.admission.classify` - scope and protection (pure);
* :mod:`kvproxy.admission.coordinator` - the FIFO coordinator and poller (asyncio).
"""
