"""kvlab: the tools around kvproxy, shipped in the same distribution.

The simulated SGLang engine (:mod:`kvlab.sim`), the agentic workload driver
(:mod:`kvlab.workload`), the in-process lab in virtual time (:mod:`kvlab.lab`), the
process launchers (:mod:`kvlab.stack`), rollouts through the real stack
(:mod:`kvlab.rollout`) and the demo's command line (:mod:`kvlab.demo`). They run as
``kvproxy sim-engine | workload | lab | demo``; what they need beyond the proxy comes
with the ``lab`` extra (``pip install 'kvproxy[lab]'``). kvlab imports kvproxy (the lab
runs the proxy's own objects); kvproxy never imports kvlab, except its command line,
lazily.
"""
