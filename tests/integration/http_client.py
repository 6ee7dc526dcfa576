"""One HTTP client for the tests' plain requests.

`httpx.get` and `httpx.post` build a client per call, and each client loads the system's CA
certificates into a new SSL context (~15 ms of a core) even for http://127.0.0.1: profiled, that
was half of a test process's CPU on a host the engines already saturate. This client is made
once; it keeps no connection alive, so each request still opens its own, as theirs did.
"""

import httpx

HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
