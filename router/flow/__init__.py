"""One request through the router, step by step: admit, wait for a turn, start (choose the path
and workers, retry), relay, migrate, account. No HTTP here: the routes call these steps."""
