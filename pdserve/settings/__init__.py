"""One typed configuration per component (pydantic), each knob's type, default and help written
once: the engine, a worker, the router, and the cluster file that composes them."""
