"""TLS that the controller and the nodes share, below both: `pool_identity` (the pool's key and
certificate, made on the controller and handed to every agent for the relay between them) and
`stream_seal` (TLS 1.3 run inside a stream that is authenticated but not private; its node end,
standard library only, is `seal_pump`). Nothing here imports the controller, the providers or
the node side: all of them stand above it."""
