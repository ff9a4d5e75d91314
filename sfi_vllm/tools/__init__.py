"""Tooling around the runtime: the ``sfi-vllm`` command (``cli``), the demo, offline batch
generation (``batch``, ``engine_job``), model preparation, the evaluation suites (``quality``,
``policies``, ``texts``, ``request_flow``) and the README's configuration table.

The runtime (the plugin, the backends, the controller and the modules they import) never imports
this package; ``tests/test_packaging.py`` checks that.
"""
