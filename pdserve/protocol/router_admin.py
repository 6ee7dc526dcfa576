"""The router's admin API as its clients call it (`pdserve roles`, `pdserve sweep`, the cluster
commands): the flex workers' split, read or set through `/pdserve/roles`."""

import httpx

from pdserve.settings.base import ConfigError

API_KEY_ENV = "PDSERVE_API_KEY"  # the key a command sends to the router
ROUTER_CALL_TIMEOUT_S = 10.0


def ask_roles(router_url: str, split: dict | None = None, api_key: str = "") -> dict:
    """The router's roles (`GET /pdserve/roles`), or its reply to setting `split` (`POST`:
    {"prefill": N, "decode": M}, either may be missing). ConfigError with the router's reason
    when it refuses the split; RuntimeError when it cannot be asked."""
    url = f"{router_url.rstrip('/')}/pdserve/roles"
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        if split is None:
            response = httpx.get(url, headers=headers, timeout=ROUTER_CALL_TIMEOUT_S)
        else:
            response = httpx.post(url, json=split, headers=headers, timeout=ROUTER_CALL_TIMEOUT_S)
    except httpx.HTTPError as error:
        raise RuntimeError(f"cannot reach the router at {url}: {error}") from None
    if response.status_code == 200:
        return response.json()
    try:
        reason = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        reason = response.text
    if response.status_code == 400:
        raise ConfigError(reason)
    raise RuntimeError(f"the router at {url} answered {response.status_code}: {reason}")
