"""The ``hookloop`` command and what it runs: ``cli``, ``scaffold`` (``hookloop
new-plugin``) and ``plot`` (``hookloop plot``)."""
