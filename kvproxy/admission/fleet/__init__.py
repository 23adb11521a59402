"""Fleet mode: every request admitted on its own against one fleet-wide ledger.

* :mod:`kvproxy.admission.fleet.ledger` - capacity, pressure, leases, TTL, epoch (pure);
* :mod:`kvproxy.admission.fleet.queue` - the two FIFOs and their decisions (pure);
* :mod:`kvproxy.admission.fleet.gate` - the mode on the event loop (futures, aging timer).

Admission's ``mode: request``, and ``mode: program`` where placement is unknown
(``ledger: fleet``, or a router policy kvproxy cannot mirror).
"""
