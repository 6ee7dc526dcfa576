"""What an engine step costs, and what each path would cost a request: one model shared by the
worker that learns it, the router that prices paths with it and the planner that simulates it."""
