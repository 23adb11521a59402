"""Program mode: a session's turns admitted as one program, per engine of a mirrored
ring (docs/admission.md#program-mode).

Pure (time injected): :mod:`~kvproxy.admission.program.params` (the parameters, derived
from the config), :mod:`~kvproxy.admission.program.events` (events and why-held),
:mod:`~kvproxy.admission.program.session` (a session and its transitions table),
:mod:`~kvproxy.admission.program.ledger` (per-engine session ledgers),
:mod:`~kvproxy.admission.program.queues` (per-engine FIFOs),
:mod:`~kvproxy.admission.program.engagement` and
:mod:`~kvproxy.admission.program.forecast` (when an engine's gate holds),
:mod:`~kvproxy.admission.program.priority`, :mod:`~kvproxy.admission.program.prefetch`
(the prefetch plan) and :mod:`~kvproxy.admission.program.core` (the decisions and the
tick). On the event loop: :mod:`~kvproxy.admission.program.gate` (futures, deadline
timer, ring mirror) and :mod:`~kvproxy.admission.program.prefetch_sender` (sends the
planned prefetches).
"""
