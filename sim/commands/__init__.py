"""The ``hawk`` command line: ``main`` lists the commands (name, module, help), builds the
parser and dispatches, importing a group's module only when its command runs. Each command
group has its own module with its parser (``add_parser``) and ``run(args)``: ``simulate``,
``sweep``, ``compare``, ``plan``, ``bench``, ``paper``, ``devices``, ``validate``; ``args``
holds the flags they share. The layers below return data; printing is done here.

The top layer: may import anything; nothing imports it."""
