"""Program-aware admission: hold requests at kvproxy's boundary until the fleet's KV
pool can hold them (see docs/admission.md).

* :mod:`kvproxy.admission.ledger` - capacity, pressure, leases, TTL, epoch (pure);
* :mod:`kvproxy.admission.reservation` - reservation sizing (pure);
* :mod:`kvproxy.admission.classify` - scope and protection (pure);
* :mod:`kvproxy.admission.records` - the request and decision records, actions, reasons (pure);
* :mod:`kvproxy.admission.fleet_queue` - ledger mode's two FIFOs and decisions (pure);
* :mod:`kvproxy.admission.program` - program mode's decisions and tick (pure);
* :mod:`kvproxy.admission.catalogue` / :mod:`kvproxy.admission.report` - metric names
  and the stats / health / Prometheus rendering (pure);
* :mod:`kvproxy.admission.poller` - what is read from the fleet, and the loops (asyncio);
* :mod:`kvproxy.admission.coordinator` - the controller: futures and timers (asyncio).
"""
