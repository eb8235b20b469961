"""Device mesh and sharding rules."""
