"""How the services find each other: the registry interface and its clients, the key layout and the
published chain table. Routers and stage servers import only this to find each other."""
