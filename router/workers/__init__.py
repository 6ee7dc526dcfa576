"""The workers as the router sees them: membership, load, liveness, the gRPC client, the choice
policies and what their prefix caches and KV pools hold, and flex workers' roles."""
