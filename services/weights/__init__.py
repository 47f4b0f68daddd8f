"""Weights in motion: everything a producer (trainer engines, publishers) and a consumer (rollout
engines, fetchers) share, and the transports between them. The param server keeps its store,
servicer and rendezvous; it uses this package too.

    protocols.py   Bucket, WeightPublisher, WeightFetcher: the contract
    layout.py      bytes of a version: bucket layout, grouping by size, fingerprints, manifests
    convert.py     manifests and refs <-> protos
    buffers.py     reusable byte buffers (host or device)
    transports/    grpc, object_store, nccl/hccl/gloo, disk; make_publisher / make_fetcher
    client.py      ParamServerClient (the transports' link to the param server)
    wire.py        the zero-copy codec of weight chunks
    hostmem.py     malloc tuning for processes that stream weights
    in_process.py  versions kept in this process (tests, single-process runs)
"""

from .protocols import Bucket, Buckets, WeightFetcher, WeightPublisher, drain, iterate_buckets

__all__ = ["Bucket", "Buckets", "WeightFetcher", "WeightPublisher", "drain", "iterate_buckets"]
