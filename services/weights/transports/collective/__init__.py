"""The `nccl` / `hccl` (and `gloo`, for CPU) transport: a broadcast from the trainer's rank 0 to
the rollout ranks of the same device kind, the group formed through the param server.

One code path for every backend; services/common/device.py maps the backend to the device kind
(nccl: cuda, hccl: npu via torch_npu, gloo: cpu). The group is a private process group over its
own TCPStore (never the default group, which the trainer's FSDP owns).

Ordering. Receivers must be in the broadcast while the sender is, but rollouts hear of a version
from the coordinator, after the trainer commits it. So the sender first announces the version
(`announce(ref)`, wired to the trainer's CommitVersion), then waits at the param server's
rendezvous until every receiver checked in for that version, then broadcasts; `publish` then
returns the very ref it announced, so the trainer's usual CommitVersion afterwards is a no-op
re-commit (and a retried publish of the same version re-announces harmlessly). `announce`
returning False means no receiver will come (the run is stopping: the rollouts have left the
version stream); the sender then skips the broadcast rather than wait out its deadline. Without
`announce`, receivers must be told of the version some other way (tests, benchmarks). Every
receiver of a group takes part in every version: one that skips a version stalls the sender
until its deadline (then the group re-forms).

Steady groups. Once a version went through, every member starts the next one on the same group
at once, its rendezvous RPC in the background (it keeps the param server's board current; an error
there sends the next version through the rendezvous again). The rendezvous answers are barriers of
the whole group, so a member that failed the last version (it reports that first) moves everyone
to a new generation before CTRL(0) can go through on the old one (see below). With delta sync the
sender waits for its answer (while it plans its first buckets): it names the base the deltas are
taken against. CTRL(0) checks that every receiver asked for the version the sender broadcasts
(sums of v and v^2), so members on different versions find out at the first step, not at a
deadline. The one behind gives its version up (the param server refuses its check-in: the version
is gone); the others keep waiting for their background check-in, which either fails at once (a
receiver skipped the sender's version: the sender's version is gone) or answers the new
generation in which the member that was behind comes to their version. A member that gave its
version up while its check-in still waited at the param server would leave that check-in to
answer a rendezvous for a group it never joins.

Failures and generations (issue 21). Any member that fails a version (a deadline, an abort, a
peer gone, a fetch broken off) drops its group and reports its generation at its next check-in
(`failed_generation`); the param server then retires that generation, and the next version goes
through a new one that every member must join: a member that failed (the sender also listens
on a new store after a failure of its own) at its rendezvous, and a member on a steady group
when its background check-in answers the new generation before CTRL(0) went through on the old
one (it then leaves the old group and joins the new one within the same version; the sender
posts step 0 again there). The sender's and receivers' answers are barriers of the whole group,
so no member is handed a generation that a late failure report retires. Each generation is its own process group under its own store
prefix (`meshrl/<group>/<generation>`), and a stalled sender's late check-in from a replaced store
is turned away: a stale member's traffic never reaches a newer generation.

Steps. A version goes out as steps t = 0, 1, ...; each step is one CTRL all-reduce (sum of
int64[14 + K]: the sender's header, which also announces the next step's kind and size, and for a
DATA step the K fingerprint columns of its bucket, computed on the device; plus the receivers'
verdicts) then, for a DATA step, one broadcast of a slot: the bucket's bytes followed by its
metadata (a serialized Manifest). The host never waits for the device except to read a CTRL
header, and both sides post a step ahead of the wire, so that between two buckets the wire idles
only for one small all-reduce:

    sender    posts CTRL(t) and DATA(t) together, then packs b(t+1) (announced in CTRL(t)) into a
              free slot while DATA(t) is on the wire; reads CTRL(t) (done once DATA(t-1) is off
              the wire) and posts CTRL(t+1) and DATA(t+1), deciding (and announcing) step t+2
    receiver  reads CTRL(t) while DATA(t) is on the wire (its receive was posted from CTRL(t-1)'s
              announcement) and at once posts CTRL(t+1) and DATA(t+1); CTRL(t+1) carries the
              verdict on b(t-1), computed on the device (a side stream sums b(t-1)'s columns as
              soon as it landed and compares them with the sender's from CTRL(t-1); the comm
              stream waits for that, the host does not); then the host queues the check of b(t)
              and hands b(t-1), checked on the host too, to the consumer

A receiver's verdict on bucket t rides in CTRL(t+2), or in CTRL(t+1) when CTRL(t) announced no
DATA (the last bucket: it is checked at once, so the end costs two control steps; both sides
build the manifest's checksum meanwhile). The sender keeps a bucket in its slot until every
receiver acked it (4 slots: three in flight, one being packed; the receiver has 3) and sends a
NACKed one again (up to max_attempts, then ABORT and DataLoss everywhere). DONE comes once every bucket is acked and carries the manifest checksum, which
receivers compare with the manifest they assembled. Pinned host buffers are kept per slot and per
step ring, never allocated per step. Every wait polls against the deadline: a stuck peer gives
DeadlineExceeded, the group is aborted and re-formed (a new generation) at the next version.

Wire buckets. Whatever size the trainer gathers buckets in (update_weights_bucket_megabytes,
2048 by default), they travel as runs of their tensors of at most WIRE_BUCKET_BYTES (512 MiB; a
larger tensor alone): the first bucket's pack and the last one's check overlap nothing, so they
grow with the bucket (BENCHMARKS.md, "nccl bucket sweep"), and the slots would take 4x the bucket
size on the trainer.

The sender plans its first two buckets and packs the first while its rendezvous RPC runs (when it
waits for one). It
returns its slots to the device allocator after each version (the trainer's steps use them). It
registers the manifest at the param server in the background (the RPC takes ~4 ms): `publish`
returns when the broadcast is done, and the next publish and `close` wait for the registration
(its error surfaces there). scripts/gpu/weights_trace.py shows where the time goes.

Modules: device.py (streams, pinned host buffers, events of one device kind), group.py (the
private process group, the CTRL word layout, rendezvous membership), sender.py (the publisher and
its per-version send session), receiver.py (the fetcher), sharded.py (every trainer rank sends
its own rows in a group of its own; the receiver joins them all and rebuilds whole tensors).
"""

from .device import device_kind
from .group import WIRE_BUCKET_BYTES
from .receiver import CollectiveFetcher
from .sender import CollectivePublisher, SendAgainProbe
from .sharded import ShardedFetcher

__all__ = ["WIRE_BUCKET_BYTES", "CollectiveFetcher", "CollectivePublisher", "SendAgainProbe", "ShardedFetcher", "device_kind"]
