"""Program-aware admission: hold requests at kvproxy's boundary until the fleet's KV
pool can hold them (see docs/admission.md).

Pure (no I/O, time injected, table-tested):

* :mod:`kvproxy.admission.records` - the request and decision records, ``Action`` / ``Reason``;
* :mod:`kvproxy.admission.classify` - scope and protection;
* :mod:`kvproxy.admission.reservation` / :mod:`kvproxy.admission.learning` - reservation
  sizing and its calibration from engines' usage reports;
* :mod:`kvproxy.admission.scaling` - the config x token scale / time scale;
* :mod:`kvproxy.admission.waitqueue` - the queue protocol both modes' queues follow;
* ledger (request) mode: :mod:`kvproxy.admission.fleet.ledger` (capacity, pressure, leases,
  TTL, epoch) and :mod:`kvproxy.admission.fleet.queue` (the two FIFOs, the decisions);
* program mode: :mod:`kvproxy.admission.program.events`, :mod:`kvproxy.admission.program.ledger`,
  :mod:`kvproxy.admission.program.engagement`, :mod:`kvproxy.admission.program.queues`,
  :mod:`kvproxy.admission.program.core`, :mod:`kvproxy.admission.program.priority`,
  :mod:`kvproxy.admission.program.params`;
* :mod:`kvproxy.admission.catalogue` / :mod:`kvproxy.admission.report` - metric names,
  and the stats / health / Prometheus rendering.

asyncio shells: :mod:`kvproxy.admission.waiters` (a request's handle, its future, the
deadline timer), :mod:`kvproxy.admission.fleet.gate` and
:mod:`kvproxy.admission.program.gate` (each mode on the loop),
:mod:`kvproxy.admission.poller` (what is read from the fleet, the loops) and
:mod:`kvproxy.admission.coordinator` (the controller).
"""
