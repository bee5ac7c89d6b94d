"""Helpers the tests share, one concept per module, imported as ``support.<module>``: pytest puts
``tests/`` on ``sys.path`` (``pythonpath`` in pyproject.toml), for ``tests/`` and
``property_tests/`` alike. A test never imports from another test module. A child process a test
starts finds this package through ``support.processes.python_env``.
"""
