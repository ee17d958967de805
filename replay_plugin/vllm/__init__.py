"""vLLM: the patches (``patches.py``) and the ``vllm.general_plugins`` entry point
(``plugin.register``). Importing this package does not import vllm."""
