"""The proxy overhead benchmark behind ``scripts/bench_proxy.py``.

* :mod:`.common`: constants, request bodies, statistics;
* :mod:`.targets`: the upstream, the reference forwarder and kvproxy as processes;
* :mod:`.load`: the load generators (Python clients, wrk);
* :mod:`.runner`: the measurement plan and its runner;
* :mod:`.report`: tables, target checks, machine description;
* :mod:`.cli`: argument parsing and ``main``.
"""
