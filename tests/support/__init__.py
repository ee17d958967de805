"""Helpers shared by the tests (plain functions and classes; pytest fixtures and hooks stay in the
conftest.py files).

Imported as ``from support.MODULE import NAME``: ``tests/`` is on ``sys.path`` in every pytest run
(pytest's default ``prepend`` import mode puts the directory of ``tests/conftest.py`` there, and
scripts/envs.py starts pytest in ``tests/``). Not ``tests.support``: the checkout root stays off
``sys.path`` so that ``import replay_plugin`` is the installed wheel, and some environments'
site-packages hold a top-level ``tests`` package of their own. A subprocess that needs a helper
puts ``tests/`` on its own ``sys.path`` (the tests pass the directory in its arguments or
environment).

- ``upstream``: ``need()`` / ``need_module()`` / ``pinned()`` and the per-upstream report state
  (``$REPLAY_TEST_REPORT``, written by tests/conftest.py's hooks from this one module object)
- ``procs``: ``run_python()``, ``plugin_installed_as_wheel()``, ``free_port()``
- ``skyrl_servers``: SkyRL's server in a subprocess and the requests the SkyRL tests send
- ``mrv2_cpu``: a harness shim run by path in every process of the MRV2 environments
  (envs/envs.toml ``shims``), never imported as part of this package
"""

from __future__ import annotations

import os

#: the checkout's root directory
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
