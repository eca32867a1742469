"""The node side: the agent (one per node, reached over the provider's stream) and the rank
worker processes it starts. Kept light: nothing here imports prefect or the controller."""
