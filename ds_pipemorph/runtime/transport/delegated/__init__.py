"""The delegated transport (PipeMorph §5.2): messages leave through host staging rings and delegate processes.

- ``transport``: ``DelegatedTransport``, the object the router uses, and who owns what;
- ``framing``: how a message is laid out as bytes and cut into staging slots;
- ``directions``: the state kept per link direction and per delegate queue;
- ``sending`` / ``receiving``: the data path into and out of the rings;
- ``supervision``: spawning delegates from a fork server, health checks, restarts by generation;
- ``delay_publishing``: the injected delays shared with sender delegates (testing);
- ``copier``: the copy thread that moves bytes into the rings beside the training thread;
- ``delegate_proc``: the main loop of one delegate process (imports torch only).

Nothing is imported here: a delegate process imports ``delegate_proc`` through this package.
"""
