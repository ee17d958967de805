"""Framework-free replay data and math.

Imports numpy, orjson and pybase64 freely and torch only in the modules that do tensor math
(``layout``, ``logprobs``, and the torch parts of ``routes``); never an upstream framework
(megatron, vllm, verl, skyrl). Modules: ``routes``, ``layout``, ``wire``, ``trace``,
``support``, ``logprobs``, ``sampler``; errors in ``errors``.
"""
