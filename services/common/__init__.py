"""Code shared by every meshrl service: config, logging, device, gRPC helpers, errors, data."""
