"""The fleet behind the router: engines discovered, their health, and where sessions land."""
