"""Dynamo: NVIDIA Dynamo's ``nvext`` request extension (agent hints and session control),
served by kvproxy in front of SGLang. See docs/dynamo.md.

Pure rules: :mod:`nvext` (the ``nvext`` block read and mapped: ``agent_hints``,
``session_control``, the priority rule), :mod:`binding` (``bind`` inactivity timeouts),
:mod:`streaming` (``open``: streaming-session slots and their translation),
:mod:`prefill` (the speculative prefill's request). Shells: :mod:`control`
(:class:`~kvproxy.dynamo.control.Dynamo`, the application's ``app[DYNAMO]``: timers,
slots, engine calls, counters) and :mod:`relay` (the server's HTTP relay of translated
turns). A turn's decisions are :mod:`kvproxy.proxy.dynamo_layer`.
"""
