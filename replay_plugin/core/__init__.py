"""Framework-free replay data and math.

Imports numpy, orjson and pybase64 freely and torch only in the modules that do tensor math
(``layout``, ``logprobs``, ``metrics``, and the torch parts of ``routes``); never an upstream
framework (megatron, vllm, verl, skyrl). Modules: ``routes``, ``layout``, ``wire``, ``trace``,
``support``, ``logprobs``, ``metrics`` (public as ``replay_plugin.metrics``), ``sampler``;
errors in ``errors``.
"""
