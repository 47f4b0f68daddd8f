"""Multi-turn trajectories in the rollout worker: the agent loop over the RolloutEngine contract
(loop.py), the hermes tool-call parser (parser.py), chat-template delta tokenization (chat.py) and
the trajectory type the wire carries (trajectory.py). Environments are services/environment."""
