"""meshrl: fully asynchronous RL post-training for LLMs as a mesh of Ray Serve services.

The services live in the `services` package; `meshrl.v1` holds the generated protobuf/gRPC code
of the wire contract (protos/meshrl/v1); this package adds the CLI and the public clients.
"""

__version__ = "0.1.0"
