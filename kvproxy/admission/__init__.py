"""Program-aware admission: hold requests at kvproxy's boundary until the fleet's KV
pool can hold them (see docs/admission.md).

Two modes, each a subpackage behind one protocol
(:class:`kvproxy.admission.gate.Gate`, one per :class:`kvproxy.admission.records.Mode`):

* :mod:`kvproxy.admission.fleet` - every request on its own against one fleet-wide
  ledger (``mode: request``, and program mode where placement is unknown);
* :mod:`kvproxy.admission.program` - a session's turns as one program, per engine of a
  mirrored ring.

Shared by both, pure (no I/O, time injected, table-tested):

* :mod:`kvproxy.admission.records` - the request and decision records, ``Mode``,
  ``Outcome`` (from which the action and the metric labels derive);
* :mod:`kvproxy.admission.classify` - scope and protection;
* :mod:`kvproxy.admission.reservation` / :mod:`kvproxy.admission.learning` - reservation
  sizing and its calibration from engines' usage reports;
* :mod:`kvproxy.admission.scaling` - the config x token scale / time scale;
* :mod:`kvproxy.admission.transitions` - state machines as tables;
* :mod:`kvproxy.admission.catalogue` / :mod:`kvproxy.admission.report` - metric names,
  and the stats / health / Prometheus rendering.

asyncio shells: :mod:`kvproxy.admission.waiters` (a request's handle, its future, the
deadline timer), :mod:`kvproxy.admission.gate` (the protocol each mode's gate
follows), :mod:`kvproxy.admission.poller` (what is read from the fleet, the loops),
:mod:`kvproxy.admission.wiring` (the parts, built once), :mod:`kvproxy.admission.controls`
(program mode's controls as the controller offers them),
:mod:`kvproxy.admission.view` (what admission shows) and
:mod:`kvproxy.admission.coordinator` (the controller).
"""
