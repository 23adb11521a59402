"""The request path: intercepting, planning and relaying each request to the router."""
