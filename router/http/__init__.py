"""The router's HTTP surface: one APIRouter per concern (router/app.py assembles them), the
OpenAI request types, response shapes, errors and API keys. Routes reach the router's parts
through `request.app.state` (see router/app.py)."""
