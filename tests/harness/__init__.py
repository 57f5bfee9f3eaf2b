"""Test harness: real processes and links to inject faults into (link proxies, fault meshes, etcd clusters).
Shipped with the tests, not in the wheel; scripts/ import it from a checkout."""
