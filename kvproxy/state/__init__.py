"""State several kvproxy replicas share (``state.backend: redis``): the operations and
the memory store that defines them (:mod:`~kvproxy.state.core`), their Redis scripts
(:mod:`~kvproxy.state.scripts`), the Redis client (:mod:`~kvproxy.state.redis_store`) and
the asyncio shell the session lifecycle uses (:mod:`~kvproxy.state.shared`)."""
