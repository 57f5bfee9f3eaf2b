"""stagemesh: distributed inference of causal LMs over gRPC (README.md, docs/). Importing it changes nothing in
the process: the services' own process settings are made by their entry point, stagemesh.cli."""

__version__ = "0.2.0"
