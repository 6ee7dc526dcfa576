"""What the routers of one cluster share in Redis (flex roles, revoked keys) and the loop that
keeps this router's view equal to it."""
