"""The router's HTTP routes, one APIRouter per concern; router/app.py assembles them. Each
route reaches the router's parts through `request.app.state` (see router/app.py)."""
