"""Local model folders made without a model hub: SmolLM2 from the package registry (converted
once) and the tiny random-weight Llama the tests use; `pdserve model`."""
