"""The toolkit every remote provider (ssh and aws, slurm, kubernetes) starts its node agents with.

A provider brings only its transport, a way to run `python -c CODE ARGS` on a node and talk to it
over that process's stdin and stdout (an SSH channel, an srun step, a pod exec); the rest is here,
written once:

- `agent_start`: the one bootstrap (seal, env, Python check and its verdict, the package's
  have/need, the agent) and `AgentStarter`, the controller's side of it.
- `reattach`: a new stream to a running agent through its door, sealed where the stream is not private.
- `python_check`, `env_in`, `package_in`: the node-side pieces of the bootstrap and their controller halves.
- `bridge`: an asyncssh process as local pipes; `workdir`: a workdir onto a node, content-addressed.
"""
