"""The ``hawk`` command line: ``main`` builds the parser and dispatches; each command group
has its own module (``simulate``, ``paper``, ...), and ``args`` holds the flags they share.

The top layer: may import anything; nothing imports it."""
