"""Session KV lifecycle: identity and injection (``identity``), the session table
(``table``) and the asyncio close sequence (``lifecycle``). See docs/sessions.md."""
