"""gRPC's transport for a stagemesh process, set before grpc is imported (stagemesh.cli imports this first; the
tests' conftest too): GRPC_TRANSPORT_EXPERIMENTS turns off the EventEngine client,
listener and endpoints, so that the thread polling the completion queue reads the socket itself. With them on, a
message received crosses three threads (an EventEngine poller, grpc.aio's completion-queue thread, the event
loop); off, two. A 1 KiB round trip on a grpc.aio stream between two processes went 301.6 -> 175.7 µs here
(scripts/dev/bench_hop.py), and each hop of a tiny 2-stage chain ~240 -> ~170 µs (docs/decisions.md, "Performance"). A
GRPC_EXPERIMENTS the user set is kept as set.
A library user who imports stagemesh (its stubs, its client) gets none of this: only the processes stagemesh
starts set it.
"""

import os

GRPC_TRANSPORT_EXPERIMENTS = "-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints"
os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_TRANSPORT_EXPERIMENTS)
